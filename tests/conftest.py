"""Test-suite wide set-up: the conformance suite's pytest plugin (see tests/conformance), and
this folder on ``sys.path`` so tests import the shared :mod:`isa` helpers by name (with
``--import-mode=importlib`` test folders are not on it)."""

import sys
from pathlib import Path

import pytest

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

pytest_plugins = ["mixprec.testing.pytest_plugin"]


@pytest.hookimpl(tryfirst=True)  # before -m deselects: in both runs of make
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files holding ``slow`` tests first, each file's tests in their order: ``make test``
    and ``make test-slow`` share the files among two workers (pytest-xdist, ``--dist
    loadfile``), and a heavy file handed out last would leave one worker idle while the other
    runs it. Sorted before ``-m`` deselects, so the files with heavy cases lead ``make test``
    too (their other tests are the suite's heaviest: builds of the kernels, subprocesses)."""
    heavy = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in heavy)
