"""Fault injection for the NumPy reference backend: a bad step never damages a model.

Hypothesis draws fault sequences (inf, NaN or a huge finite value in one gradient or in the
input batch) under every preset; after every step the weights, masters and momentum buffers
are finite, a skipped step changed none of them, and the scale and counters follow the
core state machine fed the same skips.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mixprec import StepGuard
from mixprec.kit import NORM_LIMIT, RepeatedSkipWarning
from mixprec_numpy import MLP, SGD, Trainer, state

#: ``edit_*``: written into a master gradient after ``unscale_()`` (issue 21)
SKIPPED = ("grad_inf", "grad_nan", "grad_huge", "input_nan", "edit_nan", "edit_huge")
FAULTS = ("none", *SKIPPED, "input_huge")
PRESETS = ("O0", "O1", "O2", "O1-bf16", "O2-bf16", "O3-bf16")
X = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
Y = np.array([0, 1, 2, 0, 1, 2, 0, 1])


def _arrays(trainer: Trainer) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for i, (param, master) in enumerate(trainer.masters.pairs):
        out[f"param {i}"] = np.asarray(param.data, dtype=np.float32).copy()
        out[f"master {i}"] = np.asarray(master.data, dtype=np.float32).copy()
    for key, value in vars(trainer.optimizer).items():
        if isinstance(value, dict):
            for k, v in value.items():
                if isinstance(v, np.ndarray):
                    out[f"state {key} {k}"] = v.astype(np.float32)
    return out


def _step(trainer: Trainer, model: MLP, fault: str) -> bool:
    x = X.copy()
    if fault == "input_nan":
        x[1, 0] = math.nan
    elif fault == "input_huge":
        x[1, 0] = 1e30
    with np.errstate(all="ignore"):
        model.loss(x, Y)
        trainer.backward()
    if fault.startswith("grad_"):
        param = model.parameters()[0]
        huge = 3e19 * trainer.scaler.scale  # once unscaled: finite, its square is not
        value = {"grad_inf": math.inf, "grad_nan": math.nan, "grad_huge": huge}[fault]
        with np.errstate(over="ignore"):
            param.grad.reshape(-1)[0] = value
    if fault.startswith("edit_"):
        trainer.unscale_()
        master = trainer.masters.pairs[0][1]
        master.grad.reshape(-1)[0] = math.nan if fault == "edit_nan" else 3e19
    return trainer.step()


@settings(max_examples=40, deadline=None)
@given(
    preset=st.sampled_from(PRESETS),
    faults=st.lists(st.sampled_from(FAULTS), min_size=1, max_size=12),
)
def test_fault_sequences_never_damage_the_model(preset: str, faults: list[str]) -> None:
    model = MLP([4, 5, 3])
    trainer = Trainer(model, SGD(lr=0.1, momentum=0.9), policy=preset, guard={"warn_after": 3})
    scale = state(trainer).policy.loss_scale
    skips = in_a_row = 0
    for i, fault in enumerate(faults):
        before = _arrays(trainer)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            skipped = _step(trainer, model, fault)
            scale = scale.update(skipped).state
        when = f"step {i} ({fault}) under {preset}"
        after = _arrays(trainer)
        assert all(np.isfinite(a).all() for a in after.values()), when
        if fault in SKIPPED:
            assert skipped, when
        if skipped:
            assert all(np.array_equal(a, before[n]) for n, a in after.items()), when
        skips += skipped
        in_a_row = in_a_row + 1 if skipped else 0
        snap = state(trainer)
        assert (snap.steps, snap.skipped_steps, snap.loss_scale) == (i + 1, skips, scale.scale)
        warned = [w for w in caught if issubclass(w.category, RepeatedSkipWarning)]
        assert len(warned) == (in_a_row > 0 and in_a_row % 3 == 0), when


def test_a_gradient_whose_square_overflows_is_skipped_and_named() -> None:
    model = MLP([4, 5, 3])
    trainer = Trainer(model, SGD(lr=0.1, momentum=0.9), policy="O0", guard=StepGuard(0))
    model.loss(X, Y)
    trainer.backward()
    model.parameters()[1].grad.reshape(-1)[0] = 2 * NORM_LIMIT
    assert trainer.step()
    assert trainer.overflows[-1].params == (model.parameters()[1].name,)


def test_a_gradient_written_after_unscale_is_checked_at_the_step() -> None:
    """``unscale_(); master.grad[0, 0] = nan; step()`` wrote NaN into the weights."""
    for preset in PRESETS:
        model = MLP([4, 5, 3])
        trainer = Trainer(model, SGD(lr=0.1, momentum=0.9), policy=preset)
        assert not _step(trainer, model, "none")
        before = _arrays(trainer)
        assert _step(trainer, model, "edit_nan"), preset
        after = _arrays(trainer)
        assert all(np.array_equal(a, before[n]) for n, a in after.items()), preset
        assert not _step(trainer, model, "none"), preset
