"""Test-suite wide set-up: the conformance suite's pytest plugin (see tests/conformance), and
this folder on ``sys.path`` so tests import the shared :mod:`isa` helpers by name (with
``--import-mode=importlib`` test folders are not on it)."""

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

pytest_plugins = ["mixprec.testing.pytest_plugin"]
