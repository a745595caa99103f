"""Small models, data and loops shared by the torch backend's tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec.torch as mpt


def mlp(seed: int = 0, *, batchnorm: bool = False, width: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(16, width)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(width))
    layers += [
        nn.ReLU(),
        nn.Linear(width, width),
        nn.LayerNorm(width),
        nn.ReLU(),
        nn.Linear(width, 5),
    ]
    return nn.Sequential(*layers)


def tanh_net(seed: int = 0) -> nn.Module:
    """The compensated tests' classifier: Linear 6→16, tanh, Linear 16→3."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


#: One fixed batch for :func:`tanh_net` (inputs, class labels).
TANH_X = torch.randn(32, 6, generator=torch.Generator().manual_seed(1))
TANH_Y = torch.randint(0, 3, (32,), generator=torch.Generator().manual_seed(2))


def train_tanh(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    """``steps`` plain steps (no loss scale) on the fixed batch; the losses."""
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(TANH_X).float(), TANH_Y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def working_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages behind the optimizer's parameters (the compensated
    working masters between steps), read without ``master_params`` (which fills them)."""
    storages = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            storage = p.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def batch(step: int, n: int = 64, scale: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 16, generator=gen) * scale, torch.randint(0, 5, (n,), generator=gen)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    *,
    inject_inf: bool = False,
    clip: float | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
) -> float:
    """One user-style step on batch ``step``; returns the loss."""
    x, y = batch(step)
    optimizer.zero_grad()
    loss = loss_fn(model(x), y)
    with mpt.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    if inject_inf:
        grad = next(p.grad for p in model.parameters() if p.grad is not None)
        grad.view(-1)[0] = float("inf")
    if clip is not None:
        mpt.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(mpt.master_params(optimizer), clip)
    optimizer.step()
    return float(loss.detach())


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Copies of params, masters and optimizer state, for exact comparisons."""
    out: dict[str, Any] = {
        "params": [p.detach().clone() for p in model.parameters()],
    }
    if optimizer is not None:
        out["masters"] = [m.detach().clone() for m in mpt.master_params(optimizer)]
        out["state"] = [
            {
                k: v.clone() if isinstance(v, torch.Tensor) else v
                for k, v in optimizer.state[m].items()
            }
            for m in mpt.master_params(optimizer)
            if m in optimizer.state
        ]
    return out


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of nested tensors (NaN equals NaN)."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.is_floating_point():
            return bool(torch.equal(_bits(a), _bits(b)))
        return bool(torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(same(x, y) for x, y in zip(a, b, strict=True))
        )
    return bool(a == b)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)
