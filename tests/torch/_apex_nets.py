"""Models and data the apex-compat tests share (``test_apex_amp*.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from mixprec.compat import apex_amp as amp
from mixprec_torch.integrations import apex_functions


@pytest.fixture(autouse=True)
def fresh_registry() -> Iterator[None]:
    """Functions a test registers with amp are forgotten after it."""
    saved = list(apex_functions._REGISTERED)
    yield
    apex_functions._REGISTERED[:] = saved


def net(seed: int = 0, width: int = 8) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))


def data(step: int) -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(step))


def grads_of(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in amp.master_params(opt)]
