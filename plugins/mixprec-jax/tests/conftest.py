"""The JAX backend's tests, run in their own virtual environment (``.venv-jax``: JAX needs
NumPy 2). Two CPU devices are forced before JAX starts, for the multi-device tests; every
other test runs on the first. The last two lines are all mixprec's conformance suite takes."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
).strip()

pytest_plugins = ["mixprec.testing.pytest_plugin"]
mixprec_backends = ["jax"]
