"""An empty batch under every FP8 recipe runs as it does under O1-bf16 (issue 37).

It was a raw torch error (``amax()`` of no element, a reshape of none, a row reduction over
an empty dimension); now the output is an empty tensor, the weight gradient is zero, and
the delayed recipe's amax histories record nothing for the tensors that had no element.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from _fp8_tasks import one_thread  # noqa: E402, F401
from torch import nn  # noqa: E402

import mixprec.torch as mpt  # noqa: E402
from mixprec.kit import FORWARD_FORMAT  # noqa: E402
from mixprec_torch.fp8.numerics import dequantise, quantise  # noqa: E402

RECIPES = ("tensorwise", "rowwise", "delayed", "mxfp8")
POLICIES = [f"{base},fp8={recipe}" for base in ("O1-fp8", "O2-fp8") for recipe in RECIPES]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _wrapped(policy: str) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return mpt.wrap(model, optimizer, policy=policy)  # type: ignore[no-any-return]


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    optimizer.zero_grad()
    out = model(x)
    loss = out.float().pow(2).sum()  # a sum: 0 over no rows, as a per-sample loss summed
    with mpt.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    return out


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("policy", ["O1-bf16", *POLICIES])
@pytest.mark.parametrize("shape", [(0, 32), (0, 5, 32), (3, 0, 32)])
def test_an_empty_batch_runs_and_changes_no_weight(policy: str, shape: tuple[int, ...]) -> None:
    """Run as found: a batch, an empty batch, a batch (O1-bf16 ran it; every FP8 recipe
    raised a torch RuntimeError or IndexError)."""
    model, optimizer = _wrapped(policy)
    gen = torch.Generator().manual_seed(1)
    _step(model, optimizer, torch.randn(4, 32, generator=gen))
    before = _weights(model)
    out = _step(model, optimizer, torch.randn(*shape, generator=gen))
    assert out.shape == (*shape[:-1], 16) and out.numel() == 0
    after = _weights(model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # zero gradients, SGD
    out = _step(model, optimizer, torch.randn(4, 32, generator=gen))
    assert out.shape == (4, 16) and bool(torch.isfinite(out).all())
    assert not all(torch.equal(after[k], v) for k, v in _weights(model).items())


def _history(model: nn.Module) -> dict[str, tuple[float, ...]]:
    layers: Any = model._mixprec.group.fp8  # type: ignore[union-attr]
    return dict(layers.state.amax_history)


@pytest.mark.parametrize("base", ["O1-fp8", "O2-fp8"])
def test_an_empty_batch_puts_nothing_into_the_delayed_histories_of_its_tensors(
    base: str,
) -> None:
    model, optimizer = _wrapped(f"{base},fp8=delayed(history=4)")
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        _step(model, optimizer, torch.randn(4, 32, generator=gen) * 3)
    before = _history(model)
    _step(model, optimizer, torch.randn(0, 32))
    after = _history(model)
    for layer in ("fc1", "fc2"):
        for role in ("input", "grad_output"):  # no element: no amax, not a 0 that looks seen
            assert after[f"{layer}:{role}"] == before[f"{layer}:{role}"]
        assert len(after[f"{layer}:weight"]) == 3  # the weight did run
    assert all(v > 0 for values in after.values() for v in values)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("shape", [(0, 32), (32, 0), (0, 0)])
def test_an_empty_operand_quantises_to_an_empty_operand(
    recipe: str, shape: tuple[int, int]
) -> None:
    x = torch.randn(*shape)
    quantised = quantise(x, FORWARD_FORMAT, recipe, 1)
    assert quantised.q.shape == x.shape and quantised.q.dtype == torch.float8_e4m3fn
    assert dequantise(quantised).shape == x.shape
