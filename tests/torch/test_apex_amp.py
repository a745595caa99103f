"""apex-style training code through ``from mixprec.compat import apex_amp as amp``.

Written from apex's documented behaviour (its L0 amp suite's topics): casts and promotion,
several models, optimizers and losses with injected overflows, delayed unscaling,
checkpoint and resume, add_param_group, registered functions, hysteresis.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from _apex_nets import (  # noqa: E402
    data,
    fresh_registry,  # noqa: F401 (its autouse fixture)
    grads_of,
    net,
)
from torch import nn  # noqa: E402

import mixprec  # noqa: E402
from mixprec.compat import apex_amp as amp  # noqa: E402
from mixprec.errors import CheckpointError, MixprecWarning, PolicyError  # noqa: E402

pytestmark = pytest.mark.torch
ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ initialize


def test_return_shapes_follow_what_was_given() -> None:
    model = amp.initialize(net(), opt_level="O1-bf16", verbosity=0)
    assert isinstance(model, nn.Module)
    models = [net(1), net(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    got_models, got_opts = amp.initialize(models, opts, opt_level="O2-bf16", verbosity=0)
    assert isinstance(got_models, list) and isinstance(got_opts, list)
    assert [p.dtype for p in got_models[0].parameters()] == [torch.bfloat16] * 4
    assert all(p.dtype == torch.float32 for p in amp.master_params(got_opts[1]))


def test_o1_casts_matmuls_and_promotes_mixed_adds_on_float16() -> None:
    model = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    half = F.linear(x.half(), model.weight.half(), model.bias.half())
    model = amp.initialize(model, opt_level="O1", verbosity=0)  # apex O1: float16 ops
    out = model(x)
    assert torch.equal(out, half.float())  # the linear ran in float16
    assert out.dtype == torch.float32  # mixprec's O1 hands float32 to the loss
    assert model.weight.dtype == torch.float32  # O1 keeps float32 weights


def test_cast_model_type_false_keeps_float32_weights_and_options_map() -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(
        model,
        opt,
        opt_level="O2",
        cast_model_type=torch.bfloat16,
        keep_batchnorm_fp32="False",
        verbosity=0,
    )
    assert next(model.parameters()).dtype == torch.bfloat16
    model = amp.initialize(net(), opt_level="O1-bf16", cast_model_type=False, verbosity=0)
    assert next(model.parameters()).dtype == torch.float32
    model = amp.initialize(net(), opt_level="O2", cast_model_type=False, verbosity=0)
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # apex: O2 uncast


class _Mixed(nn.Module):
    """A model whose own parameters are in two dtypes (a bfloat16 head on a float32 body)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).relu().to(torch.bfloat16)).float()


def test_cast_model_type_false_keeps_each_parameters_own_dtype_with_masters() -> None:
    model = _Mixed()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    head_before = model.head.weight.detach().float().clone()
    model, opt = amp.initialize(model, opt, opt_level="O2-bf16", cast_model_type=False, verbosity=0)
    assert [p.dtype for p in model.parameters()] == [torch.float32] * 2 + [torch.bfloat16] * 2
    assert [p.dtype for p in amp.master_params(opt)] == [torch.float32] * 4
    assert torch.equal(model.state_dict()["head.weight"], head_before)
    for step in range(3):
        opt.zero_grad()
        with amp.scale_loss(model(data(step)).pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
    masters = list(amp.master_params(opt))
    assert masters[0] is model.body.weight  # float32: its own master, no copy
    assert masters[2] is not model.head.weight  # bfloat16: a float32 master
    assert not torch.equal(masters[2], head_before)  # trained
    assert torch.equal(model.head.weight, masters[2].to(torch.bfloat16))
    assert torch.equal(model.state_dict()["head.weight"], masters[2])  # exact checkpoint


def test_cast_model_type_false_without_masters_updates_the_bf16_weights_directly() -> None:
    model = _Mixed()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = amp.initialize(model, opt, opt_level="O1-bf16", cast_model_type=False, verbosity=0)
    before = model.head.weight.detach().clone()
    with amp.scale_loss(model(data(0)).pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert list(amp.master_params(opt))[2] is model.head.weight  # apex O1: no masters
    assert model.head.weight.dtype == torch.bfloat16
    assert not torch.equal(model.head.weight, before)


def test_bad_arguments_raise_before_anything_changes() -> None:
    model = net()
    with pytest.raises(PolicyError, match="num_losses"):
        amp.initialize(model, opt_level="O1-bf16", num_losses=0, verbosity=0)
    with pytest.raises(PolicyError, match="patch_torch_functions"):
        amp.initialize(model, opt_level="O2", patch_torch_functions=True, verbosity=0)
    with pytest.raises(PolicyError):
        amp.initialize(model, opt_level="O7", verbosity=0)
    assert next(model.parameters()).dtype == torch.float32


def test_o3_with_a_static_scale_is_accepted_with_a_warning() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(MixprecWarning, match="without float32 master"):
        model, opt = amp.initialize(model, opt, opt_level="O3", loss_scale=128.0, verbosity=0)
    loss = model(torch.ones(1, 2, dtype=torch.float16)).float().sum()
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled.item() == pytest.approx(loss.item() * 128, rel=1e-3)
        scaled.backward()
    assert torch.equal(model.bias.grad, torch.ones(2, dtype=torch.float16))  # unscaled
    opt.step()


def test_disabled_amp_changes_nothing() -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    got_model, got_opt = amp.initialize(model, opt, enabled=False)
    assert got_model is model and got_opt is opt
    loss = model(data(0)).sum()
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled is loss


# ------------------------------------------------------------------ losses and optimizers


def test_two_losses_accumulate_exactly_what_one_backward_gives() -> None:
    """Each loss is unscaled on exit and added to what the previous one left (apex)."""
    ref = net()
    x = data(0)
    (ref(x).pow(2).mean() + ref(x).abs().mean()).backward()
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(
        model, opt, opt_level="O0", loss_scale="dynamic", num_losses=2, verbosity=0
    )
    with amp.scale_loss(model(x).pow(2).mean(), opt, loss_id=0) as scaled:
        scaled.backward()
    with amp.scale_loss(model(x).abs().mean(), opt, loss_id=1) as scaled:
        scaled.backward()
    for got, want in zip(grads_of(opt), [p.grad for p in ref.parameters()], strict=True):
        torch.testing.assert_close(got, want)


def test_delay_unscale_accumulates_micro_batches() -> None:
    ref = net()
    for step in range(2):
        ref(data(step)).pow(2).mean().backward()
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2-bf16", loss_scale=1024.0, verbosity=0)
    for step in range(2):
        loss = model(data(step)).float().pow(2).mean()
        with amp.scale_loss(loss, opt, delay_unscale=step == 0) as scaled:
            scaled.backward()
    for got, want in zip(grads_of(opt), [p.grad for p in ref.parameters()], strict=True):
        torch.testing.assert_close(got, want, rtol=0.05, atol=0.02)  # bf16 forward
    opt.step()


def _two_models_two_losses(overflow_loss: int | None, steps: int = 3) -> tuple[list, list]:
    a, b = net(1), net(2)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    (a, b), (opt_a, opt_b) = amp.initialize(
        [a, b],
        [opt_a, opt_b],
        opt_level="O2-bf16",
        loss_scale="dynamic",
        num_losses=2,
        verbosity=0,
    )
    for step in range(steps):
        opt_a.zero_grad()
        opt_b.zero_grad()
        x = data(step)
        for loss_id, (model, opt) in enumerate([(a, opt_a), (b, opt_b)]):
            loss = model(x).float().pow(2).mean()
            if step == 1 and loss_id == overflow_loss:
                loss = loss * float("inf")
            with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
                scaled.backward()
        opt_a.step()
        opt_b.step()
    return [copy.deepcopy(m.state_dict()) for m in (a, b)], amp.loss_scalers()


def test_only_the_optimizer_of_the_overflowing_loss_skips_and_only_its_scaler_backs_off() -> None:
    clean, clean_scalers = _two_models_two_losses(None)
    hit, hit_scalers = _two_models_two_losses(1)
    # model a never saw the overflow: identical to the clean run
    for key, value in clean[0].items():
        assert torch.equal(hit[0][key], value)
    # model b skipped step 1: it differs
    assert any(not torch.equal(hit[1][k], v) for k, v in clean[1].items())
    assert [s.skipped_steps for s in hit_scalers] == [0, 1]
    assert [s.scale for s in hit_scalers] == [65536.0, 32768.0]
    assert [s.scale for s in clean_scalers] == [65536.0, 65536.0]


def test_one_loss_over_two_optimizers_skips_both() -> None:
    a, b = net(1), net(2)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b)]
    (a, b), opts = amp.initialize([a, b], opts, opt_level="O2-bf16", loss_scale=64.0, verbosity=0)
    before = [copy.deepcopy(m.state_dict()) for m in (a, b)]
    x = data(0)
    loss = (a(x).float().sum() + b(x).float().sum()) * float("inf")
    with amp.scale_loss(loss, opts) as scaled:
        scaled.backward()
    for opt in opts:
        opt.step()
    for model, saved in zip((a, b), before, strict=True):
        assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())


def test_bad_loss_id_names_num_losses() -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2-bf16", verbosity=0)
    with pytest.raises(PolicyError, match="num_losses"):
        with amp.scale_loss(model(data(0)).sum(), opt, loss_id=1):
            pass


def test_apex_hysteresis_tolerates_isolated_overflows() -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scale = mixprec.DynamicScale(init=256.0, hysteresis=2, refill="finite")
    model, opt = amp.initialize(model, opt, opt_level="O2-bf16", loss_scale=scale, verbosity=0)
    for step in range(6):
        opt.zero_grad()
        loss = model(data(step)).float().sum()
        if step % 2 == 0:
            loss = loss * float("inf")
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    scaler = amp.loss_scalers()[0]
    assert scaler.skipped_steps == 3 and scaler.scale == 256.0


# ------------------------------------------------------------------ checkpoints


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        loss = model(data(step)).float().pow(2).mean()
        if step == 2:
            loss = loss * float("inf")  # a skip and a backoff inside the checkpointed part
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()


def _fresh(policy: str = "O2-bf16") -> tuple[nn.Module, torch.optim.Optimizer]:
    model = net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return amp.initialize(model, opt, opt_level=policy, loss_scale="dynamic", verbosity=0)


def test_checkpoint_and_resume_continue_exactly() -> None:
    model, opt = _fresh()
    _train(model, opt, range(4))
    saved = {
        "model": copy.deepcopy(model.state_dict()),
        "optimizer": copy.deepcopy(opt.state_dict()),
        "amp": copy.deepcopy(amp.state_dict()),
    }
    _train(model, opt, range(4, 7))
    want = copy.deepcopy(model.state_dict())

    model, opt = _fresh()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    amp.load_state_dict(saved["amp"])
    assert amp.loss_scalers()[0].scale == 32768.0
    _train(model, opt, range(4, 7))
    for key, value in want.items():
        assert torch.equal(model.state_dict()[key], value)


def test_loads_the_loss_scale_of_a_checkpoint_apex_saved() -> None:
    _fresh()
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 7}})
    state = amp.loss_scalers()[0].state
    assert (state.scale, state.good_steps) == (1024.0, 7)
    with pytest.raises(CheckpointError, match="num_losses"):
        amp.load_state_dict({"loss_scaler0": {}, "loss_scaler1": {}})
    assert amp.loss_scalers()[0].scale == 1024.0
