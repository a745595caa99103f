"""Fault injection for the PyTorch backend: a bad step never damages a model.

Hypothesis draws sequences of faults (inf, NaN or a huge finite value in the loss, in one
gradient, or in the input batch) and runs them through tiny wrapped models under every
preset. After every step nothing non-finite may sit in the weights, the masters, the
optimizer state or the BatchNorm statistics; a skipped step must leave all of them exactly
as they were; and the scale and counters must follow the core state machine fed the same
skips.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch import nn  # noqa: E402

import mixprec.torch as mpt  # noqa: E402
from mixprec import DynamicScale, StepGuard  # noqa: E402
from mixprec.errors import LossScaleError, MixprecWarning  # noqa: E402
from mixprec.kit import NORM_LIMIT, RepeatedSkipWarning  # noqa: E402

#: Faults a step can carry; the first ones must be skipped whatever the policy. The
#: ``edit_*`` ones are written after ``unscale_()``, into a master gradient or (``model``)
#: the model's own gradient, as a clip or a user's hook would (issue 21).
EDITS = ("edit_nan", "edit_huge", "edit_model_nan")
SKIPPED = (
    "loss_inf",
    "loss_nan",
    "loss_huge",
    "grad_inf",
    "grad_nan",
    "grad_huge",
    "input_nan",
    *EDITS,
)
FAULTS = ("none", *SKIPPED, "input_huge")
PRESETS = ("O0", "O1-bf16", "O2-bf16", "O3-bf16", "O1", "O2", "O3")
FP16 = ("O1", "O2", "O3")
WARN_AFTER = 3


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    """One intra-op thread: these tensors are tiny, and on a shared CPU torch's worker threads
    spin against other processes (measured: 160 ms per 8x4 batch_norm with 2 threads under
    load, 0.1 ms with 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-6)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


class Rig:
    """A wrapped tiny net and the state a fault may not damage."""

    def __init__(self, preset: str, optimizer: str, seed: int = 0, **wrap: Any) -> None:
        model = _net(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MixprecWarning)  # fp16 Adam eps lint, O3 notes
            self.model, self.opt = mpt.wrap(model, _optimizer(optimizer, model), preset, **wrap)
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(8, 3, generator=gen)
        self.y = torch.randn(8, 2, generator=gen)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Weights, masters, optimizer state and BatchNorm statistics, by name."""
        out = {f"param {n}": p for n, p in self.model.named_parameters()}
        out.update({f"buffer {n}": b for n, b in self.model.named_buffers()})
        for i, master in enumerate(mpt.master_params(self.opt)):
            out[f"master {i}"] = master
            for key, value in self.opt.state.get(master, {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"state {i} {key}"] = value
        return out

    def step(self, fault: str) -> bool:
        """One step carrying ``fault``; returns whether it was skipped."""
        x = self.x.clone()
        if fault == "input_nan":
            x[1, 0] = math.nan
        elif fault == "input_huge":
            x[1, 0] = 1e30
        self.opt.zero_grad()
        loss = ((self.model(x).float() - self.y) ** 2).mean()
        if fault == "loss_inf":
            loss = loss * math.inf
        elif fault == "loss_nan":
            loss = loss * math.nan
        elif fault == "loss_huge":
            loss = loss * 1e30
        with mpt.scale_loss(loss, self.opt) as scaled:
            scaled.backward()
        grad = next(p.grad for p in self.model.parameters() if p.grad is not None)
        if fault in ("grad_inf", "grad_nan", "grad_huge"):
            # "huge": once unscaled, finite in float32 and bfloat16 but its square is not
            huge = 3e19 * mpt.state(self.opt).loss_scale
            grad.view(-1)[0] = {"grad_inf": math.inf, "grad_nan": math.nan, "grad_huge": huge}[
                fault
            ]
        if fault in EDITS:
            mpt.unscale_(self.opt)
            if fault == "edit_model_nan":
                edited = next(p.grad for p in self.model.parameters() if p.grad is not None)
            else:
                edited = next(m.grad for m in mpt.master_params(self.opt) if m.grad is not None)
            edited.view(-1)[0] = math.nan if fault != "edit_huge" else 3e19
        self.opt.step()
        return mpt.state(self.opt).last_step_skipped


def _assert_finite(tensors: dict[str, torch.Tensor], when: str) -> None:
    bad = [n for n, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    assert not bad, f"non-finite values after {when}: {bad}"


def run_faults(preset: str, optimizer: str, faults: list[str]) -> None:
    rig = Rig(preset, optimizer, guard=StepGuard(warn_after=WARN_AFTER))
    scale = mpt.state(rig.opt).policy.loss_scale  # the core machine, fed the same skips
    skips = in_a_row = 0
    for i, fault in enumerate(faults):
        before = {n: t.detach().clone() for n, t in rig.tensors().items()}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            skipped = rig.step(fault)
            scale = scale.update(skipped).state
        when = f"step {i} ({fault}) under {preset}/{optimizer}"
        after = rig.tensors()
        _assert_finite(after, when)
        if fault in SKIPPED:
            assert skipped, f"{when} was applied"
        if fault == "none" and preset not in FP16:
            assert not skipped, f"{when} was skipped"
        if skipped:
            changed = [n for n, t in after.items() if not torch.equal(t, before[n])]
            assert not changed, f"{when} was skipped but changed {changed}"
        skips += skipped
        in_a_row = in_a_row + 1 if skipped else 0
        state = mpt.state(rig.opt)
        assert (state.steps, state.skipped_steps) == (i + 1, skips), when
        assert state.last_step_skipped is skipped
        assert state.loss_scale == scale.scale, when
        warned = [w for w in caught if issubclass(w.category, RepeatedSkipWarning)]
        assert len(warned) == (in_a_row > 0 and in_a_row % WARN_AFTER == 0), when
        if warned:
            assert f"skipped {in_a_row} steps in a row" in str(warned[0].message)


@settings(max_examples=30, deadline=None)
@given(
    preset=st.sampled_from(PRESETS),
    optimizer=st.sampled_from(("adam", "sgd")),
    faults=st.lists(st.sampled_from(FAULTS), min_size=1, max_size=10),
)
def test_fault_sequences_never_damage_the_model(
    preset: str, optimizer: str, faults: list[str]
) -> None:
    run_faults(preset, optimizer, faults)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(
    preset=st.sampled_from(PRESETS),
    optimizer=st.sampled_from(("adam", "sgd")),
    faults=st.lists(st.sampled_from(FAULTS), min_size=10, max_size=30),
)
def test_long_fault_sequences_never_damage_the_model(
    preset: str, optimizer: str, faults: list[str]
) -> None:
    run_faults(preset, optimizer, faults)


# ---------------------------------------------------------------------- the cases


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("preset", ["O1-bf16", "O2-bf16", "O0"])
def test_a_huge_finite_loss_is_skipped_without_loss_scaling(preset: str, optimizer: str) -> None:
    rig = Rig(preset, optimizer)
    rig.step("none")
    assert rig.step("loss_huge")  # 1e30: Adam's grad**2 would be inf, SGD weights 1e27
    assert mpt.overflowing_params(rig.opt)
    for _ in range(3):
        assert not rig.step("none")
    _assert_finite(rig.tensors(), "a huge loss")
    assert max(float(p.detach().abs().max()) for p in rig.model.parameters()) < 100


@pytest.mark.parametrize("fault", ["edit_nan", "edit_model_nan"])
@pytest.mark.parametrize("preset", PRESETS)
def test_a_gradient_written_after_unscale_is_checked_at_the_step(preset: str, fault: str) -> None:
    """The issue's reproduction: ``unscale_(o); master.grad[0, 0] = nan; o.step()`` wrote NaN
    into the weights under every policy; the guard now checks at ``step()``."""
    low = {"loss_scale": DynamicScale(init=2.0**8)} if preset in ("O1", "O2") else {}
    rig = Rig(preset, "adam", **low)  # a scale whose first step does not overflow float16
    assert not rig.step("none")
    before = {n: t.detach().clone() for n, t in rig.tensors().items()}
    assert rig.step(fault)
    _assert_finite(rig.tensors(), f"a NaN written after unscale_ under {preset}")
    assert all(torch.equal(t, before[n]) for n, t in rig.tensors().items())
    assert not rig.step("none")  # and the next clean step is applied


@pytest.mark.parametrize("preset", ["O3-bf16-kahan", "O3-bf16-sr"])
def test_a_master_gradient_written_after_unscale_is_checked_under_compensation(
    preset: str,
) -> None:
    rig = Rig(preset, "sgd")
    assert not rig.step("none")
    weights = [p.detach().clone() for p in rig.model.parameters()]
    assert rig.step("edit_nan")
    assert all(torch.equal(a, b) for a, b in zip(weights, rig.model.parameters(), strict=True))


def test_a_member_written_after_the_round_opened_is_checked_at_its_own_step() -> None:
    """Two optimizers of one backward pass: the first ``step()`` checks both; a write into
    the second one's gradients between the two steps is checked at its own step."""
    torch.manual_seed(0)
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b)]
    (a, b), (opt_a, opt_b) = mpt.wrap([a, b], opts, "O2-bf16")
    x = torch.randn(4, 3)
    with mpt.scale_loss((a(x).float() + b(x).float()).sum(), [opt_a, opt_b]) as scaled:
        scaled.backward()
    opt_a.step()
    mpt.master_params(opt_b)[0].grad[0, 0] = math.nan
    weight = b.weight.detach().clone()
    opt_b.step()
    assert torch.equal(b.weight, weight) and torch.isfinite(b.weight).all()
    assert torch.isfinite(mpt.master_params(opt_b)[0]).all()


def test_the_apex_drop_in_checks_a_master_gradient_written_after_scale_loss() -> None:
    from mixprec.compat import apex_amp as amp

    model = _net(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2-bf16", verbosity=0)
    loss = model(torch.randn(8, 3)).float().sum()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    next(iter(amp.master_params(opt))).grad[0, 0] = math.nan
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.isfinite(m).all() for m in amp.master_params(opt))


def test_a_large_but_representable_gradient_is_applied() -> None:
    rig = Rig("O2-bf16", "adam")
    rig.opt.zero_grad()
    loss = ((rig.model(rig.x).float() - rig.y) ** 2).mean()
    with mpt.scale_loss(loss, rig.opt) as scaled:
        scaled.backward()
    grad = rig.model[0].weight.grad
    grad.view(-1)[0] = NORM_LIMIT / 4  # squared: 2e37, inside float32
    rig.opt.step()
    assert not mpt.state(rig.opt).last_step_skipped
    _assert_finite(rig.tensors(), "a large gradient")


def test_a_norm_that_overflows_only_in_the_sum_is_skipped_and_named() -> None:
    rig = Rig("O1-bf16", "sgd")
    rig.opt.zero_grad()
    loss = ((rig.model(rig.x).float() - rig.y) ** 2).mean()
    with mpt.scale_loss(loss, rig.opt) as scaled:
        scaled.backward()
    rig.model[0].weight.grad.view(-1)[0] = 0.8 * NORM_LIMIT  # each square fits float32,
    rig.model[3].weight.grad.view(-1)[0] = 0.9 * NORM_LIMIT  # their sum does not
    before = rig.model[3].weight.detach().clone()
    rig.opt.step()
    assert mpt.state(rig.opt).last_step_skipped
    assert mpt.overflowing_params(rig.opt) == ["3.weight"]  # the largest norm
    assert torch.equal(rig.model[3].weight, before)


@pytest.mark.parametrize("preset", ["O2-bf16", "O1", "O0"])
def test_repeated_skips_warn_with_steps_and_parameters(preset: str) -> None:
    rig = Rig(preset, "sgd")  # the default: 10 in a row
    rig.step("none")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RepeatedSkipWarning)
        for _ in range(9):
            rig.step("grad_nan")
    with pytest.warns(RepeatedSkipWarning, match=r"10 steps in a row .*steps 1-10.*0\.weight"):
        rig.step("grad_nan")


def test_wrap_refuses_a_bad_guard_before_changing_anything() -> None:
    model = _net(0)
    weight = model[0].weight
    with pytest.raises(ValueError, match="warn_after"):
        mpt.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2-bf16", guard={"x": 1})
    assert model[0].weight is weight and weight.dtype == torch.float32
    assert getattr(model, "_mixprec", None) is None


# ---------------------------------------------------------------------- BatchNorm statistics


def _stats(model: nn.Module) -> list[torch.Tensor]:
    bn = model[1]
    return [bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone()]


@pytest.mark.parametrize("preset", ["O2-bf16", "O1", "O0"])
def test_a_skipped_nan_batch_leaves_batchnorm_statistics_as_they_were(preset: str) -> None:
    rig = Rig(preset, "adam")
    rig.step("none")
    before = _stats(rig.model)
    assert rig.step("input_nan")
    after = _stats(rig.model)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    rig.model.eval()
    assert torch.isfinite(rig.model(rig.x)).all()  # torch.amp alone gives NaN here
    rig.model.train()
    assert not rig.step("none")  # a good step still moves the statistics
    assert not torch.equal(_stats(rig.model)[0], before[0])
    assert int(_stats(rig.model)[2]) == int(before[2]) + 1


def test_accumulated_forwards_of_a_skipped_step_are_all_undone() -> None:
    rig = Rig("O2-bf16", "sgd")
    before = _stats(rig.model)
    rig.opt.zero_grad()
    for fault in ("none", "nan"):
        x = rig.x.clone()
        if fault == "nan":
            x[0, 0] = math.nan
        loss = ((rig.model(x).float() - rig.y) ** 2).mean()
        with mpt.scale_loss(loss, rig.opt) as scaled:
            scaled.backward()
    rig.opt.step()
    assert mpt.state(rig.opt).last_step_skipped
    assert all(torch.equal(a, b) for a, b in zip(before, _stats(rig.model), strict=True))


def test_a_floor_that_raises_still_restores_the_statistics() -> None:
    floor = DynamicScale(init=1.0, min=1.0, on_floor="raise")
    rig = Rig("O2", "sgd", loss_scale=floor)
    rig.step("none")
    before = _stats(rig.model)
    weights = [p.detach().clone() for p in rig.model.parameters()]
    with pytest.raises(LossScaleError, match="floor"):
        rig.step("input_nan")
    assert all(torch.equal(a, b) for a, b in zip(before, _stats(rig.model), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(weights, rig.model.parameters(), strict=True))
