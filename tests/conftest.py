"""Test-suite wide set-up: the conformance suite's pytest plugin (see tests/conformance)."""

pytest_plugins = ["mixprec.testing.pytest_plugin"]
