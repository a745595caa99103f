"""wrap: shapes, the resolved policy, lint, and the catalogue of refused inputs."""

from __future__ import annotations

import logging
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from _torch_nets import mlp, same, snapshot, train_step  # noqa: E402
from torch import nn  # noqa: E402

import mixprec  # noqa: E402
import mixprec.torch as mpt  # noqa: E402
from mixprec.errors import (  # noqa: E402
    MixprecError,
    MixprecWarning,
    PolicyError,
    UnsupportedDtypeError,
    WrapError,
)

pytestmark = pytest.mark.torch


def test_returns_the_shapes_it_was_given() -> None:
    model = mlp()
    assert mpt.wrap(model, policy="O1") is model  # inference: no optimizer
    a, b = mlp(), mlp(seed=1)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    models, opts = mpt.wrap([a, b], [oa, ob], policy="O2")
    assert models == [a, b] and opts == [oa, ob]
    c = mlp()
    oc = torch.optim.AdamW(c.parameters())
    m, o = mpt.wrap(c, oc, policy="O2-bf16")
    assert m is c and o is oc and isinstance(o, torch.optim.AdamW) and type(o).__name__ == "AdamW"


@pytest.mark.cpu_isa
def test_auto_resolves_for_the_device_and_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    preferred = mpt.capabilities().preferred_lowp("cpu")
    with caplog.at_level(logging.INFO, logger="mixprec.torch"):
        if preferred is None:  # the warning says what this CPU lacks
            with pytest.warns(MixprecWarning, match="float32") as warned:
                model, opt = mpt.wrap(model, opt)
            assert mpt.capabilities().device("cpu").note in str(warned[0].message)
        else:
            model, opt = mpt.wrap(model, opt)
    policy = mpt.state(opt).policy
    assert policy.is_resolved
    expected = (
        mixprec.resolve_auto(mixprec.get_policy("auto"), preferred)
        if preferred
        else mixprec.get_policy("O0")
    )
    assert policy == expected
    assert [r.getMessage() for r in caplog.records if r.name == "mixprec.torch"] == [
        f"mixprec.torch.wrap: policy {policy} on cpu"
    ]
    assert mixprec.Policy.from_dict(opt.state_dict()["mixprec"]["policy"]) == policy


def test_capabilities_describe_cpu() -> None:
    """Whether bfloat16 is fast here: tests/torch/test_cpu_capability.py."""
    caps = mpt.capabilities()
    cpu = caps.device("cpu")
    assert caps.backend == "torch" and caps.framework_version == torch.__version__
    assert {"float32", "bfloat16", "float16"} <= set(cpu.compute_dtypes)
    assert f"ATen {torch.backends.cpu.get_cpu_capability()}" in cpu.note


def test_optimizer_state_built_before_wrap_moves_to_the_masters() -> None:
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    opt.zero_grad()
    model, opt = mpt.wrap(model, opt, policy="O2")
    masters = mpt.master_params(opt)
    assert all(m in opt.state and opt.state[m]["exp_avg"].dtype == torch.float32 for m in masters)
    train_step(model, opt, 0)


# ------------------------------------------------------------------------ O3 and lint


def zero_grad_layer_model() -> nn.Module:
    """A layer whose gradient is exactly zero: its output is multiplied by 0."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.used = nn.Linear(8, 4)
            self.unused = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x) + 0.0 * self.unused(x)

    return Net()


def adam_loop(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x).float(), y)
        with mpt.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()


def test_pure_fp16_adam_warns_at_wrap_and_really_produces_nan() -> None:
    model = zero_grad_layer_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # eps=1e-8 underflows in float16
    with pytest.warns(MixprecWarning, match=r"eps=1e-08 underflows to 0 in float16.*Fix"):
        model, opt = mpt.wrap(model, opt, policy="O3")
    adam_loop(model, opt)
    assert torch.isnan(model.unused.weight).all()  # 0 / (sqrt(0) + 0): the warning was right
    assert torch.isfinite(model.used.weight).all()


def test_o2_keeps_adam_in_float32_and_trains_without_nan() -> None:
    model = zero_grad_layer_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = mpt.wrap(model, opt, policy="O2")  # no warning: state is float32
    adam_loop(model, opt)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert mpt.state(opt).skipped_steps == 0


def test_bf16_o3_adam_does_not_warn() -> None:
    model = zero_grad_layer_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = mpt.wrap(model, opt, policy="O3-bf16")  # 1e-8 is representable in bfloat16
    adam_loop(model, opt)


def test_fp16_params_under_a_loss_scaler_without_masters_are_refused_by_name() -> None:
    model = zero_grad_layer_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model)
    with pytest.raises(WrapError, match=r"used\.weight, used\.bias, unused\.weight.*O2"):
        mpt.wrap(model, opt, policy="O3", loss_scale="dynamic")
    assert same(snapshot(model), before) and type(opt) is torch.optim.SGD


def test_keep_dtypes_leaves_each_parameter_its_dtype_and_masters_only_the_low_ones() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2).to(torch.float16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mpt.wrap(model, opt, policy="O2-bf16", keep_dtypes=True)
    assert [p.dtype for p in model.parameters()] == [torch.float32] * 2 + [torch.float16] * 2
    masters = list(mpt.master_params(opt))
    assert masters[0] is model[0].weight  # float32: no copy
    assert masters[2] is not model[1].weight and masters[2].dtype == torch.float32
    out = model[0](torch.randn(3, 4))  # inputs are not cast to the policy's bfloat16
    assert out.dtype == torch.float32


def test_keep_dtypes_still_refuses_a_loss_scale_without_masters_for_fp16() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2).to(torch.float16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model)
    with pytest.raises(WrapError, match=r"1\.weight, 1\.bias"):
        mpt.wrap(model, opt, policy="O1", loss_scale="dynamic", keep_dtypes=True)
    assert same(snapshot(model), before) and type(opt) is torch.optim.SGD


# -------------------------------------------------------------- the bad-input catalogue


def untouched(model: nn.Module, opt: torch.optim.Optimizer | None) -> dict[str, Any]:
    return {
        "params": [(p, p.detach().clone(), p.dtype) for p in model.parameters()],
        "opt": None
        if opt is None
        else (type(opt), [list(g["params"]) for g in opt.param_groups], dict(opt.state)),
        "hooks": (
            len(model._forward_hooks),
            len(model._forward_pre_hooks),
            len(model._state_dict_hooks),
        ),
    }


def assert_untouched(
    record: dict[str, Any], model: nn.Module, opt: torch.optim.Optimizer | None
) -> None:
    now = untouched(model, opt)
    for (p, value, dtype), (q, _, qdtype) in zip(record["params"], now["params"], strict=True):
        assert p is q and dtype == qdtype and torch.equal(value, q)
    if opt is not None:
        assert record["opt"][0] is now["opt"][0]
        assert all(a == b for a, b in zip(record["opt"][1], now["opt"][1], strict=True))
        assert not hasattr(opt, "_mixprec")
    assert record["hooks"] == now["hooks"]


def test_wrapping_twice_is_refused() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mpt.wrap(model, opt, policy="O2")
    record = untouched(model, None)
    with pytest.raises(WrapError, match=r"already wrapped.*single wrap call"):
        mpt.wrap(model, policy="O1")
    assert_untouched(record, model, None)
    assert mpt.state(opt).policy == mixprec.get_policy("O2")
    fresh_model = mlp()
    opt2 = torch.optim.SGD(fresh_model.parameters(), lr=0.1)
    mpt.wrap(fresh_model, opt2, policy="O1")
    other = mlp()
    record = untouched(other, None)
    with pytest.raises(WrapError, match="was already wrapped"):
        mpt.wrap(other, opt2)
    assert_untouched(record, other, None)
    outer = nn.Sequential(model, nn.Linear(5, 2))
    with pytest.raises(WrapError, match="submodule '0' was already wrapped"):
        mpt.wrap(outer, policy="O1")


def test_a_ddp_or_dataparallel_model_must_be_wrapped_first() -> None:
    from torch.nn.parallel import DistributedDataParallel

    model = mlp()
    record = untouched(model, None)
    with pytest.raises(
        WrapError, match=r"wrap the bare model|convert the bare model.*DataParallel\(model\)"
    ):
        mpt.wrap(nn.DataParallel(model), policy="O2")
    assert_untouched(record, model, None)
    ddp = DistributedDataParallel.__new__(DistributedDataParallel)  # no process group needed
    nn.Module.__init__(ddp)
    ddp.module = model
    with pytest.raises(
        WrapError, match=r"mixprec.torch.wrap\(model, opt.*DistributedDataParallel\(model\)"
    ):
        mpt.wrap(ddp, policy="O2")
    assert_untouched(record, model, None)


def test_optimizer_with_parameters_outside_the_models_is_refused() -> None:
    model, other = mlp(), nn.Linear(3, 3)
    opt = torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1)
    record = untouched(model, opt)
    with pytest.raises(WrapError, match=r"2 parameter\(s\) that are not in the models.*\[3, 3\]"):
        mpt.wrap(model, opt, policy="O2")
    assert_untouched(record, model, opt)


def test_parameters_on_a_device_that_cannot_compute_are_refused() -> None:
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UnsupportedDtypeError, match=r"meta.*to_empty"):
        mpt.wrap(model, opt, policy="O2")
    assert type(opt) is torch.optim.SGD and model.weight.dtype == torch.float32


def test_a_policy_dtype_the_device_cannot_compute_is_refused_untouched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As on a pre-Ampere GPU asked for bfloat16: the error names a policy that would work."""
    import mixprec_torch.wrapping.planning as planning

    fp16_only = mixprec.DeviceCapability("cpu", ("float32", "float16"), ("float16",))
    monkeypatch.setattr(planning, "device_capability", lambda device: fp16_only)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    record = untouched(model, opt)
    with pytest.raises(UnsupportedDtypeError, match=r"needs bfloat16.*compute=float16") as err:
        mpt.wrap(model, opt, policy="O2-bf16")
    assert isinstance(err.value, MixprecError)
    assert_untouched(record, model, opt)
    mpt.wrap(model, opt, policy="O2")  # the advised policy wraps


def test_bad_policy_and_bad_arguments() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    record = untouched(model, opt)
    with pytest.raises(PolicyError, match="Did you mean 'O2'"):
        mpt.wrap(model, opt, policy="O22")
    with pytest.raises(WrapError, match=r"not a torch\.nn\.Module"):
        mpt.wrap(opt, model)
    with pytest.raises(WrapError, match=r"not a torch\.optim\.Optimizer"):
        mpt.wrap(model, [model])
    with pytest.raises(WrapError, match="passed twice"):
        mpt.wrap(model, [opt, opt])
    with pytest.raises(WrapError, match="step was replaced"):
        opt.step = lambda *a, **k: None  # type: ignore[method-assign]
        try:
            mpt.wrap(model, opt, policy="O2")
        finally:
            del opt.step
    assert_untouched(record, model, opt)
    assert all(issubclass(type(e), MixprecError) for e in (WrapError("x"), PolicyError("x")))


def test_add_param_group_maps_model_params_to_masters() -> None:
    model = mlp()
    head = list(model.parameters())[-2:]
    opt = torch.optim.SGD(list(model.parameters())[:-2], lr=0.1)
    model, opt = mpt.wrap(model, opt, policy="O2")
    opt.add_param_group({"params": head, "lr": 0.01})
    assert all(m.dtype == torch.float32 for m in opt.param_groups[1]["params"])
    train_step(model, opt, 0)
    with pytest.raises(WrapError, match="not in the models"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


@pytest.mark.cuda
def test_the_same_code_runs_float16_on_cuda() -> None:
    model = mlp().cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = mpt.wrap(model, opt, policy="O2")
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x, y = (
            torch.randn(8, 16, generator=gen).cuda(),
            torch.randint(0, 5, (8,), generator=gen).cuda(),
        )
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        with mpt.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    assert next(model.parameters()).dtype == torch.float16
    assert mpt.state(opt).policy.compute == "float16"
    o1 = mpt.wrap(mlp().cuda(), policy="O1")
    assert o1(torch.randn(2, 16, device="cuda")).dtype == torch.float32


def test_the_plan_decides_everything_and_changes_nothing() -> None:
    """wrap = plan (every check, the dtypes and masters decided) + apply; the plan alone
    leaves model and optimizer as they were, and applying it gives what wrap gives."""
    from mixprec_torch.wrapping.planning import check_arguments, first_device, plan_wrap
    from mixprec_torch.wrapping.wrap import apply_plan

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    record = untouched(model, opt)
    params = check_arguments([model], [opt])
    plan = plan_wrap([model], [opt], params, mixprec.get_policy("O2-bf16"), first_device([model]))
    assert_untouched(record, model, opt)
    assert plan.masters_on and not plan.fsdp
    assert sorted(set(plan.planned.values())) == ["bfloat16", "float32"]  # BatchNorm pinned

    group = apply_plan(plan)
    assert model[0].weight.dtype == torch.bfloat16 and model[1].weight.dtype == torch.float32
    assert mpt.state(opt).policy == plan.policy and group.masters.has_copies
    assert all(m.dtype == torch.float32 for m in mpt.master_params(opt))
