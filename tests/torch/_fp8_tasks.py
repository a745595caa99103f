"""What the FP8 tests share: one intra-op thread, and the teacher-student fitting task."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec.torch as mpt

__all__ = ["fit", "one_thread", "square_step", "start_and_end", "teacher"]


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread: the tensors are small, and on a shared CPU torch's worker threads
    spin against other processes (the training test: 74 s with 2 threads under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def teacher(out: int = 4, device: str = "cpu") -> nn.Module:
    """The fixed teacher MLP (seed 0, frozen)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, out)).to(device)
    net.requires_grad_(False)
    return net


def fit(
    student: nn.Module,
    optimizer: torch.optim.Optimizer,
    target: nn.Module,
    gen: torch.Generator,
    steps: int,
    losses: list[float],
    device: str = "cpu",
) -> None:
    """``steps`` steps of the wrapped ``student`` towards ``target`` on fresh batches drawn
    from ``gen``, each step's loss appended to ``losses``."""
    for _ in range(steps):
        x = torch.randn(64, 16, generator=gen).to(device)
        optimizer.zero_grad()
        loss = F.mse_loss(student(x).float(), target(x) * 4)
        with mpt.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        losses.append(float(loss.detach()))


def square_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> float:
    """One step of ``model`` on the loss ``mean(model(x)**2)``; the loss."""
    optimizer.zero_grad()
    loss = model(x).float().square().mean()
    with mpt.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    return float(loss.detach())


def start_and_end(losses: list[float]) -> tuple[float, float]:
    """The mean loss of the first 5 and of the last 10 steps."""
    return sum(losses[:5]) / 5, sum(losses[-10:]) / 10
