"""Runs mixprec's conformance suite on the built-in backends and the NumPy plugin.

Exactly what a third-party backend writes (plus the plugin line, which for this repository
lives in the top-level configuration because pytest reads ``pytest_plugins`` only there).
A backend listed here that cannot be built fails ``test_backend_builds``: install the NumPy
plugin with ``pip install -e ./plugins/mixprec-numpy``.
"""

from __future__ import annotations

import pytest

mixprec_backends = ["torch", "mxnet", "numpy"]


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin("mixprec.testing.pytest_plugin"):
        raise pytest.UsageError(
            "tests/conformance needs mixprec's pytest plugin: add "
            "pytest_plugins = ['mixprec.testing.pytest_plugin'] to tests/conftest.py "
            "(or pass -p mixprec.testing.pytest_plugin)"
        )
