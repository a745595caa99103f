"""``optimizer.step(closure)`` on wrapped optimizers (issue 10, item 2).

Under policies without loss scaling a closure works as in plain PyTorch: LBFGS re-runs it
during its line search, and single-evaluation optimizers (the Lightning and Accelerate
style) run it exactly once. Under loss scaling it is refused before anything runs.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from _torch_nets import batch, mlp  # noqa: E402
from torch import nn  # noqa: E402

import mixprec.torch as mpt  # noqa: E402
from mixprec.errors import StepOrderError  # noqa: E402

pytestmark = pytest.mark.torch


class Counted:
    """A user's closure: zero the gradients, forward, backward, return the loss; with
    ``scaled``, the backward goes through ``scale_loss`` (the README's idiom)."""

    def __init__(self, model: nn.Module, opt: Any, step: int = 0, *, scaled: bool = False) -> None:
        self.model, self.opt = model, opt
        self.x, self.y = batch(step)
        self.calls = 0
        self.losses: list[float] = []
        self.scaled = scaled

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        self.opt.zero_grad()
        loss = F.cross_entropy(self.model(self.x), self.y)
        if self.scaled:
            with mpt.scale_loss(loss, self.opt) as scaled:
                scaled.backward()
        else:
            loss.backward()
        self.losses.append(float(loss.detach()))
        return loss


def _masters(opt: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in mpt.master_params(opt)]


def test_lbfgs_trains_the_float32_masters_under_o2_bf16() -> None:
    model = mlp()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    model, opt = mpt.wrap(model, opt, policy="O2-bf16")
    closure = Counted(model, opt)
    first = float(opt.step(closure).detach())
    for _ in range(4):
        opt.step(closure)
    assert closure.calls > 5  # LBFGS re-evaluates inside each step
    assert closure.losses[-1] < 0.5 * first
    for param, master in zip(model.parameters(), mpt.master_params(opt), strict=True):
        assert master.dtype == torch.float32
        assert torch.equal(param, master.detach().to(param.dtype))
    # the masters carry more than bfloat16's bits: LBFGS updated them, not the model
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in mpt.master_params(opt))
    assert mpt.state(opt).steps == 5


@pytest.mark.parametrize("policy", ["O0", "O1-bf16", "O2-bf16", "O3-bf16"])
def test_scale_loss_inside_an_lbfgs_closure_trains_as_a_plain_backward(policy: str) -> None:
    """Every policy without loss scaling: the README's ``scale_loss`` idiom inside the
    closure that LBFGS re-evaluates gives the same masters as ``loss.backward()``."""
    results = []
    for scaled in (True, False):
        model = mlp()
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
        model, opt = mpt.wrap(model, opt, policy=policy)
        closure = Counted(model, opt, scaled=scaled)
        for _ in range(2):
            opt.step(closure)
        assert closure.calls > 2 and mpt.state(opt).steps == 2
        results.append((_masters(opt), closure.losses))
    (scaled_masters, scaled_losses), (plain_masters, plain_losses) = results
    assert scaled_losses == plain_losses
    for a, b in zip(scaled_masters, plain_masters, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("policy", ["O2-bf16", "O1-bf16", "O0"])
def test_a_closure_runs_once_and_steps_as_the_explicit_loop(policy: str) -> None:
    results = []
    for use_closure in (True, False):
        model = mlp()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        model, opt = mpt.wrap(model, opt, policy=policy)
        for step in range(3):
            closure = Counted(model, opt, step, scaled=step == 1)
            if use_closure:
                loss = opt.step(closure)
                assert closure.calls == 1 and isinstance(loss, torch.Tensor)
            else:
                closure()
                opt.step()
        results.append(_masters(opt))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_a_closure_with_an_inf_gradient_skips_the_step() -> None:
    model = mlp()
    model, opt = mpt.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="O2-bf16")
    before = _masters(opt)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        x, y = batch(0)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        model[0].weight.grad.view(-1)[0] = float("inf")
        return loss

    assert isinstance(opt.step(closure), torch.Tensor)
    assert mpt.state(opt).last_step_skipped
    assert all(torch.equal(a, b) for a, b in zip(before, _masters(opt), strict=True))


def test_accelerate_passes_the_closure_through() -> None:
    accelerate = pytest.importorskip("accelerate")
    model = mlp()
    model, opt = mpt.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="O2-bf16")
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="no")
    model, prepared = accelerator.prepare(model, opt)
    before = _masters(opt)
    closure = Counted(model, prepared)
    prepared.step(closure)
    assert closure.calls == 1 and not mpt.state(opt).last_step_skipped
    assert not all(torch.equal(a, b) for a, b in zip(before, _masters(opt), strict=True))


def test_a_closure_under_loss_scaling_is_refused_before_it_runs() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)  # float16: tiny tensors only on CPUs
    model, opt = mpt.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="O2")
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    calls = []

    def closure() -> torch.Tensor:
        calls.append(1)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    before = _masters(opt)
    with pytest.raises(StepOrderError, match="not supported, and the closure was not run"):
        opt.step(closure)
    with pytest.raises(StepOrderError, match="scale_loss") as refused:
        opt.step(closure)
    assert "loss_scale=None" in str(refused.value)
    assert calls == [] and mpt.state(opt).steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, _masters(opt), strict=True))
    with mpt.scale_loss(F.cross_entropy(model(x), y), opt) as scaled:  # the fix it names
        scaled.backward()
    opt.step()
    assert mpt.state(opt).steps == 1


def test_a_second_backward_before_every_optimizer_stepped_says_what_happened() -> None:
    """Two optimizers of one wrap call, one loss: the first one's step() unscaled both;
    a new backward before the second one's step() is refused, naming that."""
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 3)
    (a, b), (opt_a, opt_b) = mpt.wrap(
        [a, b],
        [torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)],
        policy="O1-bf16",
    )
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with mpt.scale_loss(F.cross_entropy(b(a(x)), y), [opt_a, opt_b]) as scaled:
        scaled.backward()
    opt_a.step()
    with pytest.raises(
        StepOrderError, match=r"another optimizer of the same wrap call.*own step\(\) has not run"
    ):
        with mpt.scale_loss(F.cross_entropy(b(a(x)), y), [opt_a, opt_b]) as scaled:
            scaled.backward()
    opt_b.step()  # the refusal changed nothing: the round completes
    assert mpt.state(opt_b).steps == 1


def test_a_closure_after_unscale_is_refused() -> None:
    model = mlp()
    model, opt = mpt.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="O2-bf16")
    Counted(model, opt)()
    mpt.unscale_(opt)
    closure = Counted(model, opt)
    with pytest.raises(StepOrderError, match="without a closure"):
        opt.step(closure)
    assert closure.calls == 0
    opt.step()  # the refusal left the iteration intact
    assert mpt.state(opt).steps == 1
