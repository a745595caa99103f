"""Fault injection for the Gluon backend: a bad step never damages a net.

The same attack as ``tests/torch/test_faults.py``: Hypothesis draws fault sequences (inf, NaN
or a huge value in the loss, in one gradient, or in the input batch) for tiny hybridized nets
with BatchNorm under every preset this CPU runs (float16 is refused on a CPU context). After
every step nothing non-finite may sit in the weights, masters, optimizer state or BatchNorm
statistics; a skipped step leaves them exactly as they were; the scale and counters follow
the core state machine fed the same skips. bfloat16 runs as float32 islands on this CPU, so
the nets stay tiny.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest

mx = pytest.importorskip("mxnet")

import numpy as np  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from mxnet import autograd, gluon, nd  # noqa: E402

import mixprec.mxnet as mpx  # noqa: E402
from mixprec import StepGuard  # noqa: E402
from mixprec.kit import NORM_LIMIT, RepeatedSkipWarning  # noqa: E402

SKIPPED = ("loss_inf", "loss_nan", "loss_huge", "grad_inf", "grad_nan", "grad_huge", "input_nan")
FAULTS = ("none", *SKIPPED, "input_huge")
PRESETS = ("O0", "O1-bf16", "O2-bf16", "O3-bf16")
WARN_AFTER = 3


def _net(seed: int) -> gluon.HybridSequential:
    mx.random.seed(seed)
    net = gluon.nn.HybridSequential()
    net.add(
        gluon.nn.Dense(4, in_units=3),
        gluon.nn.BatchNorm(in_channels=4),
        gluon.nn.Activation("relu"),
        gluon.nn.Dense(2, in_units=4),
    )
    net.initialize(mx.init.Xavier())
    net.hybridize()
    return net


def _numpy(array: Any) -> np.ndarray:
    return np.asarray(array.astype("float32").asnumpy())


class Rig:
    """A Trainer over a tiny net and the state a fault may not damage."""

    def __init__(self, preset: str, optimizer: str, seed: int = 0, **kwargs: Any) -> None:
        self.net = _net(seed)
        params = {"learning_rate": 0.01} if optimizer == "adam" else {"learning_rate": 0.05}
        if optimizer == "sgd":
            params["momentum"] = 0.9
        self.trainer = mpx.Trainer(self.net, optimizer, params, policy=preset, **kwargs)
        rng = np.random.default_rng(seed)
        self.x = nd.array(rng.standard_normal((8, 3)))
        self.y = nd.array(rng.standard_normal((8, 2)))

    def arrays(self) -> dict[str, np.ndarray]:
        """Weights, BatchNorm statistics, masters and optimizer state, by name."""
        out = {f"param {n}": _numpy(p.data()) for n, p in self.net.collect_params().items()}
        for i, master in enumerate(self.trainer.master_params()):
            out[f"master {i}"] = _numpy(master.data())
        # the updater's states: what Gluon's own save_states writes (read here, not changed)
        for key, state in self.trainer._updaters[0].states.items():
            todo = [state]
            j = 0
            while todo:
                item = todo.pop()
                if isinstance(item, (list, tuple)):
                    todo.extend(item)
                elif isinstance(item, nd.NDArray):
                    out[f"state {key}.{j}"] = _numpy(item)
                    j += 1
        return out

    def step(self, fault: str) -> bool:
        x = self.x.copy()
        if fault == "input_nan":
            x[1, 0] = math.nan
        elif fault == "input_huge":
            x[1, 0] = 1e30
        with autograd.record():
            loss = ((self.net(x).astype("float32") - self.y) ** 2).mean()
            if fault == "loss_inf":
                loss = loss * math.inf
            elif fault == "loss_nan":
                loss = loss * math.nan
            elif fault == "loss_huge":
                loss = loss * 1e30
        with self.trainer.scale_loss(loss) as scaled:
            autograd.backward(scaled)
        if fault in ("grad_inf", "grad_nan", "grad_huge"):
            huge = 3e19 * self.trainer.loss_scale  # once unscaled: finite, its square is not
            values = {"grad_inf": math.inf, "grad_nan": math.nan, "grad_huge": huge}
            grad = self.net[0].weight.grad()
            grad[0, 0] = values[fault]
        self.trainer.step(8)
        return self.trainer.last_step_skipped


def _assert_finite(arrays: dict[str, np.ndarray], when: str) -> None:
    bad = [n for n, a in arrays.items() if not np.isfinite(a).all()]
    assert not bad, f"non-finite values after {when}: {bad}"


def run_faults(preset: str, optimizer: str, faults: list[str]) -> None:
    rig = Rig(preset, optimizer, guard=StepGuard(warn_after=WARN_AFTER))
    scale = mpx.state(rig.trainer).policy.loss_scale
    skips = in_a_row = 0
    for i, fault in enumerate(faults):
        before = rig.arrays()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            skipped = rig.step(fault)
            scale = scale.update(skipped).state
        when = f"step {i} ({fault}) under {preset}/{optimizer}"
        after = rig.arrays()
        _assert_finite(after, when)
        if fault in SKIPPED:
            assert skipped, f"{when} was applied"
        if fault == "none":
            assert not skipped, f"{when} was skipped"
        if skipped:
            changed = [n for n, a in after.items() if not np.array_equal(a, before[n])]
            assert not changed, f"{when} was skipped but changed {changed}"
        skips += skipped
        in_a_row = in_a_row + 1 if skipped else 0
        state = mpx.state(rig.trainer)
        assert (state.steps, state.skipped_steps) == (i + 1, skips), when
        assert state.loss_scale == scale.scale, when
        warned = [w for w in caught if issubclass(w.category, RepeatedSkipWarning)]
        assert len(warned) == (in_a_row > 0 and in_a_row % WARN_AFTER == 0), when


@settings(max_examples=25, deadline=None)
@given(
    preset=st.sampled_from(PRESETS),
    optimizer=st.sampled_from(("adam", "sgd")),
    faults=st.lists(st.sampled_from(FAULTS), min_size=1, max_size=8),
)
def test_fault_sequences_never_damage_the_net(
    preset: str, optimizer: str, faults: list[str]
) -> None:
    run_faults(preset, optimizer, faults)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(
    preset=st.sampled_from(PRESETS),
    optimizer=st.sampled_from(("adam", "sgd")),
    faults=st.lists(st.sampled_from(FAULTS), min_size=8, max_size=25),
)
def test_long_fault_sequences_never_damage_the_net(
    preset: str, optimizer: str, faults: list[str]
) -> None:
    run_faults(preset, optimizer, faults)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_a_huge_finite_loss_is_skipped_under_bf16(optimizer: str) -> None:
    rig = Rig("O2-bf16", optimizer)
    rig.step("none")
    assert rig.step("loss_huge")
    assert mpx.overflowing_params(rig.trainer)
    for _ in range(2):
        assert not rig.step("none")
    arrays = rig.arrays()
    _assert_finite(arrays, "a huge loss")
    assert max(float(np.abs(a).max()) for n, a in arrays.items() if "weight" in n) < 100


def test_a_norm_that_overflows_only_in_the_sum_is_skipped_and_named() -> None:
    rig = Rig("O0", "sgd")
    with autograd.record():
        loss = ((rig.net(rig.x) - rig.y) ** 2).mean()
    with rig.trainer.scale_loss(loss) as scaled:
        autograd.backward(scaled)
    # checked as accumulated, before step(8) divides by the batch size: each square fits
    # float32, their sum does not
    rig.net[0].weight.grad()[0, 0] = 0.8 * NORM_LIMIT
    rig.net[3].weight.grad()[0, 0] = 0.9 * NORM_LIMIT
    rig.trainer.step(8)
    assert rig.trainer.last_step_skipped
    assert mpx.overflowing_params(rig.trainer) == ["3.weight"]


def test_repeated_skips_warn_with_steps_and_parameters() -> None:
    rig = Rig("O2-bf16", "sgd")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RepeatedSkipWarning)
        for _ in range(9):
            rig.step("grad_nan")
    with pytest.warns(RepeatedSkipWarning, match=r"10 steps in a row .*steps 0-9.*0\.weight"):
        rig.step("grad_nan")


def test_a_skipped_nan_batch_leaves_batchnorm_statistics_as_they_were() -> None:
    rig = Rig("O2-bf16", "adam")
    rig.step("none")
    bn = rig.net[1]
    before = [_numpy(bn.running_mean.data()), _numpy(bn.running_var.data())]
    assert rig.step("input_nan")
    after = [_numpy(bn.running_mean.data()), _numpy(bn.running_var.data())]
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    out = _numpy(rig.net(rig.x))  # inference, not recording: uses the running statistics
    assert np.isfinite(out).all() and len({tuple(row) for row in out.round(6)}) > 1
    assert not rig.step("none")  # a good step still moves them
    assert not np.array_equal(_numpy(bn.running_mean.data()), before[0])


def test_trainer_refuses_a_bad_guard() -> None:
    with pytest.raises(ValueError, match="warn_after"):
        Rig("O0", "sgd", guard={"warn_after": -1})
