"""Checkpoints: float32 masters in model.state_dict(), scaler state in optimizer.state_dict(),
bit-identical resumption."""

from __future__ import annotations

import copy
import io

import pytest

torch = pytest.importorskip("torch")

from _torch_nets import mlp, same, snapshot, train_step  # noqa: E402
from torch import nn  # noqa: E402

import mixprec  # noqa: E402
import mixprec.torch as mpt  # noqa: E402
from mixprec.errors import CheckpointError, MixprecWarning  # noqa: E402

pytestmark = pytest.mark.torch

# interval 4: at step 10 the dynamic scale is half-way through an interval
TRACE = mixprec.DynamicScale(init=2.0**12, interval=4)
INF_AT = {3, 13}


def fresh(policy: str, **overrides: object) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = mlp(batchnorm=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return mpt.wrap(model, opt, policy=policy, **overrides)


def run(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    return [train_step(model, opt, s, inject_inf=s in INF_AT) for s in steps]


def save(model: nn.Module, opt: torch.optim.Optimizer) -> bytes:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    return buffer.getvalue()


def load(blob: bytes, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    saved = torch.load(io.BytesIO(blob), weights_only=True)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])


@pytest.mark.parametrize(
    ("policy", "overrides"),
    [
        ("O1", {}),
        ("O2", {}),
        ("O2", {"loss_scale": TRACE}),
        ("O1", {"loss_scale": TRACE}),
        ("O2-bf16", {}),
        ("O3-bf16", {}),
    ],
    ids=["O1", "O2", "O2-dynamic-mid-interval", "O1-dynamic-mid-interval", "O2-bf16", "O3-bf16"],
)
def test_resume_at_step_10_is_bit_identical_at_step_20(
    policy: str, overrides: dict[str, object]
) -> None:
    model, opt = fresh(policy, **overrides)
    straight = run(model, opt, range(20))
    want = snapshot(model, opt), mpt.state(opt)

    first, first_opt = fresh(policy, **overrides)
    run(first, first_opt, range(10))
    blob = save(first, first_opt)
    if "loss_scale" in overrides:
        # backed off at step 3, grew at step 7, two good steps into the next interval
        assert [e.kind for e in mpt.state(first_opt).events] == ["skip", "backoff", "growth"]
        assert first_opt.state_dict()["mixprec"]["scaler"]["loss_scale"]["good_steps"] == 2
    resumed, resumed_opt = fresh(policy, **overrides)
    load(blob, resumed, resumed_opt)
    tail = run(resumed, resumed_opt, range(10, 20))

    assert tail == straight[10:]
    assert same(snapshot(resumed, resumed_opt), want[0])
    got = mpt.state(resumed_opt)
    assert (got.loss_scale, got.skipped_steps, got.steps) == (
        want[1].loss_scale,
        want[1].skipped_steps,
        want[1].steps,
    )


@pytest.mark.parametrize("policy", ["O1", "O2", "O2-bf16", "O3-bf16"])
def test_model_state_dict_is_float32(policy: str) -> None:
    model, opt = fresh(policy)
    run(model, opt, range(3))
    sd = model.state_dict()
    floats = {k: v for k, v in sd.items() if v.is_floating_point()}
    assert {v.dtype for v in floats.values()} == {torch.float32}
    if mixprec.get_policy(policy).uses_masters:
        masters = dict(
            zip([n for n, _ in model.named_parameters()], mpt.master_params(opt), strict=True)
        )
        for name, master in masters.items():
            assert torch.equal(sd[name], master), name  # exact masters, not upcast params


def test_plain_float32_state_dict_loads_into_a_wrapped_model_and_back() -> None:
    plain = mlp(seed=7, batchnorm=True)
    model, opt = fresh("O2")
    model.load_state_dict(plain.state_dict())
    for (name, p), master in zip(model.named_parameters(), mpt.master_params(opt), strict=True):
        assert torch.equal(master, plain.get_parameter(name))  # masters got the exact values
        assert torch.equal(p, master.to(p.dtype))  # the model got them cast
    assert same(model.state_dict(), plain.state_dict())
    run(model, opt, range(2))
    back = mlp(seed=3, batchnorm=True)
    back.load_state_dict(model.state_dict())  # a wrapped model's checkpoint into plain PyTorch
    assert same(back.state_dict(), model.state_dict())


def test_optimizer_state_dict_carries_scaler_tracker_and_policy() -> None:
    model, opt = fresh("O2", loss_scale=TRACE)
    run(model, opt, range(5))
    sd = opt.state_dict()
    extra = sd["mixprec"]
    assert extra["scaler"]["loss_scale"]["scale"] == mpt.state(opt).loss_scale
    assert extra["scaler"]["skipped_steps"] == 1
    assert extra["tracker"] == {"steps": 5}
    assert mixprec.Policy.from_dict(extra["policy"]) == mpt.state(opt).policy
    plain = torch.optim.Adam(mlp(batchnorm=True).parameters(), lr=1e-3)
    plain.load_state_dict(sd)  # plain PyTorch ignores the extra entry


def test_loading_under_another_policy_warns() -> None:
    model, opt = fresh("O2")
    run(model, opt, range(1))
    blob = save(model, opt)
    other, other_opt = fresh("O2", loss_scale=mixprec.DynamicScale(init=1024.0))
    with pytest.warns(MixprecWarning, match="saved under policy"):
        load(blob, other, other_opt)


def test_loading_a_different_kind_of_loss_scale_is_refused_before_any_change() -> None:
    model, opt = fresh("O2")
    run(model, opt, range(1))
    sd = opt.state_dict()
    target, target_opt = fresh("O2-bf16")
    before = snapshot(target, target_opt)
    with pytest.warns(MixprecWarning), pytest.raises(CheckpointError, match="loss scale"):
        target_opt.load_state_dict(sd)
    assert same(snapshot(target, target_opt), before)


def test_assign_true_is_refused() -> None:
    model, _ = fresh("O2")
    with pytest.raises(CheckpointError, match="assign=True"):
        model.load_state_dict(mlp(batchnorm=True).state_dict(), assign=True)


def test_params_changed_outside_the_step_are_saved_not_stale_masters() -> None:
    """An EMA copy (deepcopy, then in-place updates) saves its own values."""
    model, opt = fresh("O2")
    run(model, opt, range(2))
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for p in ema.parameters():
            p.mul_(0.5)
    sd = ema.state_dict()
    for name, p in ema.named_parameters():
        assert torch.equal(sd[name], p.float()), name
    # the original is unaffected
    masters = dict(
        zip([n for n, _ in model.named_parameters()], mpt.master_params(opt), strict=True)
    )
    assert all(torch.equal(model.state_dict()[n], m) for n, m in masters.items())


def test_o3_state_dict_saves_batchnorm_statistics_the_forward_updated() -> None:
    """The CPU batch-norm kernel updates bfloat16 running statistics in place without
    bumping their version counter: the save must still see the new values, not the float32
    originals from wrap."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    model, _ = mpt.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="O3-bf16")
    model(torch.randn(16, 4))
    saved = model.state_dict()["1.running_mean"]
    assert saved.dtype == torch.float32
    assert torch.equal(saved, model[1].running_mean.float())
    assert saved.abs().sum() > 0
