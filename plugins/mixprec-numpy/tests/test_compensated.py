"""The reference arithmetic of master=kahan and master=stochastic, and their checkpoints."""

from __future__ import annotations

import io

import numpy as np
import pytest

from mixprec_numpy import MLP, SGD, Trainer
from mixprec_numpy.casting import round_to_bfloat16
from mixprec_numpy.compensation import (
    Compensation,
    kahan_split,
    round_state,
    round_stochastic_to_bfloat16,
)
from mixprec_numpy.layers import Parameter

X = np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)
Y = np.arange(16) % 3
STEP = np.float32(2**-7)  # the bfloat16 spacing just above 1.0


def test_stochastic_rounding_is_unbiased_between_the_two_neighbours() -> None:
    x = np.full(100_000, 1 + STEP / 4, np.float32)
    rounded = round_stochastic_to_bfloat16(x, np.random.default_rng(1))
    assert set(np.unique(rounded).tolist()) == {1.0, float(1 + STEP)}
    assert abs(rounded.mean() - x[0]) < 1e-4  # round-to-nearest would give exactly 1.0
    exact = np.array([1.0, -2.5, 0.0], np.float32)  # bfloat16 values stay as they are
    assert round_stochastic_to_bfloat16(exact, np.random.default_rng(2)).tolist() == [1, -2.5, 0]


def test_kahan_split_holds_the_value_the_weight_alone_cannot() -> None:
    value = np.array([1 + 3 * STEP / 16, -7.123456], np.float32)
    weight, comp = kahan_split(value)
    np.testing.assert_array_equal(weight, round_to_bfloat16(value))
    assert np.all(np.abs(weight + comp - value) < np.abs(value) * 2**-15)


def _drift(strategy: str | None, steps: int = 200) -> float:
    """A weight of 1.0 pushed by updates of 2**-12 (an eighth of half a bfloat16 step)."""
    param = Parameter("w", np.ones(64, np.float32), "bfloat16")
    sgd = SGD(lr=2**-12)
    comp = None if strategy is None else Compensation([param], strategy, seed=3)
    for _ in range(steps):
        param.grad = np.full(64, -1.0, np.float32)
        if comp is None:
            sgd.update([param])
        else:
            comp.update(sgd, [param])
    best = param.data if comp is None else comp.best(param)
    return float(best.mean() - 1.0)


def test_small_updates_survive_the_strategies_and_vanish_without_them() -> None:
    wanted = 200 * 2**-12
    assert _drift(None) == 0.0  # plain bfloat16: every update rounds away
    assert _drift("kahan") == pytest.approx(wanted, rel=1e-3)
    assert _drift("stochastic") == pytest.approx(wanted, rel=0.05)


def _train(trainer: Trainer, model: MLP, steps: int) -> None:
    for _ in range(steps):
        model.loss(X, Y)
        trainer.backward()
        trainer.step()


@pytest.mark.parametrize(
    "policy",
    ["O3-bf16-kahan", "O3-bf16-sr", "O3-bf16-kahan,state=bfloat16", "O3-bf16-sr,state=bfloat16"],
)
def test_resume_repeats_the_trajectory_bit_for_bit(policy: str) -> None:
    model = MLP([4, 8, 3])
    trainer = Trainer(model, SGD(lr=0.05, momentum=0.9), policy=policy, seed=7)
    assert {p.dtype for p in model.parameters()} == {"bfloat16"}
    _train(trainer, model, 5)
    buffer = io.BytesIO()
    trainer.save(buffer)
    _train(trainer, model, 5)

    buffer.seek(0)
    resumed_model = MLP([4, 8, 3], seed=99)  # other initial weights: all come from the file
    resumed = Trainer(resumed_model, SGD(lr=0.05, momentum=0.9), policy=policy, seed=0)
    resumed.load(buffer)
    _train(resumed, resumed_model, 5)
    for a, b in zip(model.parameters(), resumed_model.parameters(), strict=True):
        np.testing.assert_array_equal(a.data, b.data)
        if trainer.compensation is not None and a.name in trainer.compensation.buffers:
            assert resumed.compensation is not None
            np.testing.assert_array_equal(
                trainer.compensation.buffers[a.name], resumed.compensation.buffers[b.name]
            )
    for name, value in trainer.optimizer.state.items():
        np.testing.assert_array_equal(value, resumed.optimizer.state[name])


@pytest.mark.parametrize("policy", ["O3-bf16-kahan,state=bfloat16", "O3-bf16-sr,state=bfloat16"])
def test_bfloat16_state_stays_on_the_grid_and_still_trains(policy: str) -> None:
    model = MLP([4, 8, 3])
    trainer = Trainer(model, SGD(lr=0.05, momentum=0.9), policy=policy, seed=7)
    first = model.loss(X, Y)
    _train(trainer, model, 10)
    assert model.loss(X, Y) < first
    state = trainer.optimizer.state
    assert state and all(np.array_equal(v, round_to_bfloat16(v)) for v in state.values())
    plain = Trainer(MLP([4, 8, 3]), SGD(lr=0.05, momentum=0.9), policy=policy.split(",")[0])
    _train(plain, plain.model, 10)
    assert not all(np.array_equal(v, round_to_bfloat16(v)) for v in plain.optimizer.state.values())


def _momentum_after(rounding: str, steps: int = 3000) -> float:
    """An exponential average ``s = 0.999 s + 0.001 g`` from 0.25 towards ``g = 1`` (the
    shape of Adam's second moment), its state stored with ``rounding`` after each step."""
    param = Parameter("w", np.zeros(4096, np.float32), "bfloat16")
    rng = np.random.default_rng(5)
    s = np.full(4096, 0.25, np.float32)
    for _ in range(steps):
        s = np.float32(0.999) * s + np.float32(0.001) * np.float32(1.0)
        if rounding == "nearest":
            s = round_to_bfloat16(s)
        elif rounding == "stochastic":
            state = {"w": s}
            round_state(state, [param], rng)
            s = state["w"]
    return float(s.mean())


def test_stochastic_state_rounding_follows_float32_where_nearest_stalls() -> None:
    exact = _momentum_after("none")
    assert _momentum_after("nearest") == 0.25  # each step moves s by less than half a spacing
    assert exact > 0.9
    assert _momentum_after("stochastic") == pytest.approx(exact, rel=0.01)


def test_saved_weights_are_weight_plus_compensation() -> None:
    model = MLP([4, 8, 3])
    trainer = Trainer(model, SGD(lr=0.01), policy="O3-bf16-kahan")
    _train(trainer, model, 3)
    buffer = io.BytesIO()
    trainer.save_parameters(buffer)
    buffer.seek(0)
    saved = np.load(buffer)
    assert trainer.compensation is not None
    param = model.parameters()[0]
    comp = trainer.compensation.buffers[param.name]
    assert np.any(comp != 0)
    np.testing.assert_array_equal(saved[f"param/{param.name}"], param.data + comp)


def test_a_bad_seed_is_refused_before_the_model_changes() -> None:
    from mixprec.errors import WrapError

    model = MLP([4, 8, 2], seed=0)
    before = [(p.data.copy(), p.dtype) for p in model.parameters()]
    with pytest.raises(WrapError, match="seed must be a non-negative int"):
        Trainer(model, SGD(lr=0.1), policy="O3-bf16-sr", seed=-1)
    for p, (data, dtype) in zip(model.parameters(), before, strict=True):
        assert p.dtype == dtype and np.array_equal(p.data, data)
