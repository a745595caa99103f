"""Shared set-up for the core tests: a fresh plugin manager, and this folder importable
(``--import-mode=importlib`` keeps test folders off ``sys.path``) for ``_policy_cases``."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mixprec.engine import plugins

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)


@pytest.fixture
def fresh_plugins() -> Iterator[None]:
    """Forget loaded plugins before and after the test (plugin presets, registrations)."""
    plugins.reset()
    yield
    plugins.reset()
