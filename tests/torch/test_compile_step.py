"""A compiled optimizer step (PyTorch's "compiling the optimizer" recipe) on a wrapped
optimizer: ``torch.compile`` of a function that calls ``optimizer.step()``.

mixprec's step protocol runs inside it: the overflow check graph-breaks at its ``.item()``,
and the compensated presets allocate and free their float32 working masters eagerly around
the optimizer's update (compiled, those two passes wrote through freed storage: a
segfault). The numbers must be the eager ones, up to the float rounding a fused kernel may
change, and a skipped step must leave the weights alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch._dynamo as dynamo  # noqa: E402
from torch import nn  # noqa: E402

import mixprec  # noqa: E402
import mixprec.torch as mpt  # noqa: E402

pytestmark = [
    pytest.mark.torch,
    # importing inductor imports torch.utils.mkldnn, which uses the deprecated script_method
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

STEPS = 4


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    dynamo.reset()
    yield
    dynamo.reset()


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 3))


def _train(policy: str, backend: str | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """STEPS AdamW steps under ``policy``; the step compiled with ``backend`` (None: eager)."""
    net = _net()
    model, opt = mixprec.torch.wrap(
        net, torch.optim.AdamW(net.parameters(), lr=1e-2), policy=policy, seed=3
    )

    def step() -> None:
        opt.step()

    run: Callable[[], None] = step if backend is None else torch.compile(step, backend=backend)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x, y = torch.randn(8, 8, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x).float(), y)
        with mpt.scale_loss(loss, opt) as scaled:
            scaled.backward()
        run()
        losses.append(loss.item())
    return losses, model.state_dict()


def _same_training(policy: str, backend: str) -> None:
    eager_losses, eager = _train(policy, None)
    compiled_losses, compiled = _train(policy, backend)
    # a fused kernel rounds once where eager rounds after every op: O3-bf16's bfloat16
    # optimizer arithmetic then differs by about a bfloat16 step, the others far less
    assert compiled_losses == pytest.approx(eager_losses, rel=2**-8)
    assert eager.keys() == compiled.keys()
    # O3-bf16's weights take bfloat16 Adam updates: a few bfloat16 steps apart after STEPS
    atol = 2**-7 if policy == "O3-bf16" else 1e-5
    for key, value in eager.items():
        torch.testing.assert_close(compiled[key], value, rtol=2**-7, atol=atol, msg=key)
    moved = _net().state_dict()
    assert any(not torch.equal(compiled[k].float(), moved[k].float()) for k in moved)


@pytest.mark.parametrize("policy", ["O3-bf16-kahan", "O3-bf16-sr", "O3-bf16-sr,state=bfloat16"])
def test_compiled_step_of_a_compensated_preset_matches_eager(policy: str) -> None:
    _same_training(policy, "inductor")


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["O2-bf16,state=int8(min_size=0)", "O0,state=int4(min_size=0)"])
def test_compiled_step_with_low_bit_state_matches_eager(policy: str) -> None:
    _same_training(policy, "inductor")


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["O1-bf16", "O2-bf16", "O3-bf16", "O2"])
def test_compiled_step_matches_eager(policy: str) -> None:
    _same_training(policy, "inductor")


@pytest.mark.slow
def test_compiled_step_still_skips_an_overflow() -> None:
    net = _net()
    model, opt = mixprec.torch.wrap(net, torch.optim.AdamW(net.parameters(), lr=1e-2), policy="O2")
    step: Callable[[], Any] = torch.compile(opt.step, backend="inductor")
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scale = _scale(opt)
    loss = nn.functional.cross_entropy(model(x).float(), y)
    with mpt.scale_loss(loss, opt) as scaled:
        scaled.backward()
    next(model.parameters()).grad[0, 0] = math.inf  # an overflow in the float16 gradient
    step()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert _scale(opt) == scale / 2


def _scale(opt: Any) -> float:
    return float(opt.state_dict()["mixprec"]["scaler"]["loss_scale"]["scale"])
