"""The loss scale on the device follows mixprec.loss_scale.DynamicScale exactly.

The torch and MXNet backends are tested against the same core state machine, so the same
overflow pattern gives the same sequence of scales on every backend.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import optax
from hypothesis import given, settings
from hypothesis import strategies as st
from tests._models import batch, loss_fn, params

import mixprec
import mixprec.jax as mpj
from mixprec.kit import DynamicScale, ScaleState, next_scale

configs = st.builds(
    DynamicScale,
    init=st.sampled_from([2.0**4, 2.0**16, 2.0**23]),
    growth=st.sampled_from([1.0, 2.0, 4.0]),
    backoff=st.sampled_from([0.5, 0.25]),
    interval=st.integers(1, 4),
    hysteresis=st.integers(1, 3),
    min=st.sampled_from([1.0, 2.0**3]),
    max=st.sampled_from([2.0**24, 2.0**127]),
    refill=st.sampled_from(["growth", "finite"]),
)


@settings(max_examples=15, deadline=None)
@given(config=configs, overflows=st.lists(st.booleans(), min_size=1, max_size=30))
def test_jitted_update_equals_the_core_state_machine(
    config: DynamicScale, overflows: list[bool]
) -> None:
    """Every overflow pattern, under scan (one compile per config): same scale and counters
    as DynamicScale.update, and a floor flag exactly where the core hits the floor."""

    def body(state: ScaleState, found: jax.Array) -> tuple[ScaleState, tuple]:
        moved = next_scale(config, state, found, jnp.where)
        new = ScaleState(
            jnp.asarray(moved.state.scale, jnp.float32),
            jnp.asarray(moved.state.good_steps, jnp.int32),
            jnp.asarray(moved.state.overflows_left, jnp.int32),
        )
        return new, (*new, jnp.asarray(moved.floor, bool))

    start = ScaleState(jnp.float32(config.scale), jnp.int32(0), jnp.int32(config.hysteresis))
    _, trace = jax.lax.scan(body, start, jnp.asarray(overflows))
    state, expected = config, []
    for found in overflows:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", mixprec.MixprecWarning)  # the floor's warning
            update = state.update(found)
        state = update.state
        floor = any(e.kind == "floor" for e in update.events)
        expected.append((state.scale, state.good_steps, state.overflows_left, floor))
    got = [tuple(x[i].item() for x in trace) for i in range(len(overflows))]
    assert got == expected


def test_the_step_skips_and_moves_the_scale_as_the_core_says() -> None:
    """A real step under O2 (float16) with a small interval: the scale the step reports and
    the next one follow DynamicScale for an overflow pattern, skips counted."""
    spec = "O2,loss_scale=dynamic(init=256,interval=2,hysteresis=2)"
    opt = mpj.Optimizer(optax.adam(1e-3), policy=spec)
    step = opt.make_step(loss_fn)
    state, core = opt.init(params()), opt.policy.loss_scale
    x, y = batch()
    for overflow in (False, False, True, False, True, True, False, False, False):
        used = core.scale
        _, state, info = step(state, (x, y, jnp.int32(overflow)))
        core = core.update(overflow).state
        assert bool(info.skipped) == overflow
        assert float(info.loss_scale) == used
        assert float(state.loss_scale.scale) == core.scale
        assert int(state.loss_scale.good_steps) == core.good_steps
        assert int(state.loss_scale.overflows_left) == core.overflows_left
    assert int(state.skipped_steps) == 3 and int(state.steps) == 9
