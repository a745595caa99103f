"""Real data: an MLP on scikit-learn's digits reaches float32 accuracy under O2-bf16."""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")
datasets = pytest.importorskip("sklearn.datasets")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import mixprec.torch as mpt  # noqa: E402

pytestmark = pytest.mark.torch


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    data = datasets.load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    split = 1400
    return x[:split], y[:split], x[split:], y[split:]


@functools.cache
def train(policy: str | None, epochs: int = 12) -> float:
    x_train, y_train, x_test, y_test = digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    if policy is not None:
        model, opt = mpt.wrap(model, opt, policy=policy)
    gen = torch.Generator().manual_seed(1)
    for _ in range(epochs):
        order = torch.randperm(len(x_train), generator=gen)
        for i in range(0, len(order), 64):
            idx = order[i : i + 64]
            opt.zero_grad()
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            if policy is None:
                loss.backward()
            else:
                with mpt.scale_loss(loss, opt) as scaled:
                    scaled.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        predicted = model(x_test).argmax(-1)
    return float((predicted == y_test).float().mean()) * 100


@pytest.mark.parametrize("policy", ["O2-bf16", "O1-bf16"])
def test_digits_mlp_reaches_float32_accuracy(policy: str) -> None:
    fp32 = train(None)
    mixed = train(policy)
    assert fp32 > 90.0
    assert mixed >= fp32 - 1.0, f"{policy}: {mixed:.2f}% vs float32 {fp32:.2f}%"
