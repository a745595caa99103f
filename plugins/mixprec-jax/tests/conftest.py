"""The JAX backend's tests, run in their own virtual environment (``.venv-jax``: JAX needs
NumPy 2). Set before JAX starts: two CPU devices, for the multi-device tests (every other
test runs on the first), and XLA's cheapest CPU code generation: the tests compile about
forty small steps and check dtypes and bits, not speed, and this halves the compile time.
The last two lines are all mixprec's conformance suite takes."""

import os

_FLAGS = (
    "--xla_force_host_platform_device_count=2",
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
)
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_FLAGS]).strip()

pytest_plugins = ["mixprec.testing.pytest_plugin"]
mixprec_backends = ["jax"]
