"""PyTorch backend tests.

With ``--import-mode=importlib`` test folders are not on ``sys.path``; the shared helpers in
``_torch_nets.py`` are imported by name, so this folder is added. CUDA-marked tests skip
cleanly on machines without a GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch
    except ImportError:  # the tests importorskip torch themselves
        return
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords and str(item.path).startswith(HERE):
            item.add_marker(skip)
