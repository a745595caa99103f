"""PyTorch misuse that used to mislead: a MixprecError naming the fix, raised first."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from _torch_nets import mlp  # noqa: E402

import mixprec.torch as mpt  # noqa: E402
from mixprec.errors import StepOrderError, WrapError  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.mark.parametrize("cast", ["float", "half", "double"])
def test_casting_a_wrapped_model_names_the_fix(cast: str) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mpt.wrap(model, opt, policy="O2-bf16")
    x = torch.randn(4, 16)
    model(x)
    getattr(model, cast)()
    with pytest.raises(WrapError, match=r"cast after mixprec\.torch\.wrap.*policy='O0'"):
        model(x)


def test_moving_a_wrapped_model_without_a_dtype_still_runs() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mpt.wrap(model, opt, policy="O2-bf16")
    model.to("cpu")
    assert model(torch.randn(4, 16)).dtype == torch.float32


# ---------------------------------------------------------------------- issue 21


def _wrapped(policy: str = "O2-bf16") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return mpt.wrap(model, opt, policy=policy)


def _loss(model: torch.nn.Module) -> torch.Tensor:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    return model(x).float().pow(2).mean()


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in [*model.parameters(), *mpt.master_params(opt)]]


@pytest.mark.parametrize("policy", ["O2-bf16", "O2"])
@pytest.mark.parametrize("unscale_first", [False, True])
def test_a_leftover_grad_scaler_is_refused_naming_the_fix(policy: str, unscale_first: bool) -> None:
    """A half-done migration: wrap(O2-bf16) but ``scaler.scale(loss).backward();
    scaler.step(opt)`` kept. The GradScaler's scale reached the weights (first update 4,736
    instead of 0.07), or its own AssertionError stopped the step."""
    model, opt = _wrapped(policy)
    with mpt.scale_loss(_loss(model), opt) as scaled:  # one mixprec step: masters have grads
        scaled.backward()
    opt.step()
    scaler = torch.amp.GradScaler("cpu")
    before = _state(model, opt)
    scaler.scale(_loss(model)).backward()
    if unscale_first:
        scaler.unscale_(opt)
    with pytest.raises(StepOrderError, match=r"torch\.amp\.GradScaler.*scale_loss.*scaler\.update"):
        scaler.step(opt)
    after = _state(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert "grad_scale" not in vars(opt) and "found_inf" not in vars(opt)


def test_a_grad_scaler_on_the_first_step_is_refused_too() -> None:
    model, opt = _wrapped()
    opt.zero_grad()
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(_loss(model)).backward()
    with pytest.raises(StepOrderError, match="GradScaler"):  # was: AssertionError of its own
        scaler.step(opt)


def test_a_disabled_grad_scaler_only_calls_step() -> None:
    model, opt = _wrapped()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    before = _state(model, opt)
    scaler.scale(_loss(model)).backward()
    scaler.step(opt)
    scaler.update()
    assert not mpt.state(opt).last_step_skipped
    assert not all(torch.equal(a, b) for a, b in zip(before, _state(model, opt), strict=True))
