"""mixprec.numerics.traced_scale: the branch-free loss-scale update equals DynamicScale.update."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mixprec.errors import MixprecError
from mixprec.numerics.loss_scale import DynamicScale, NoScale, StaticScale
from mixprec.numerics.traced_scale import (
    ScaleState,
    check_traceable,
    initial_scale,
    next_scale,
    python_where,
    scale_config_with,
)

configs = st.builds(
    DynamicScale,
    init=st.sampled_from([1.0, 2.0**8, 2.0**16, 3.0, 2.0**23]),
    growth=st.sampled_from([1.0, 2.0, 3.0, 2.0**10]),
    backoff=st.sampled_from([0.5, 0.25, 0.3]),
    interval=st.integers(1, 5),
    hysteresis=st.integers(1, 4),
    min=st.sampled_from([1.0, 0.5]),
    max=st.sampled_from([2.0**24, 2.0**127, math.inf]),
    refill=st.sampled_from(["growth", "finite"]),
)


@settings(max_examples=200, deadline=None)
@given(config=configs, overflows=st.lists(st.booleans(), max_size=40))
def test_next_scale_follows_dynamic_scale(config: DynamicScale, overflows: list[bool]) -> None:
    """Step for step, the same scale, good_steps, overflows_left and floor hits."""
    state, traced = config, initial_scale(config)
    for found_inf in overflows:
        with pytest.warns() if _hits_floor(state, found_inf) else _nothing():
            update = state.update(found_inf)
        state = update.state
        traced, floor = next_scale(config, traced, found_inf, python_where)
        assert traced == ScaleState(state.scale, state.good_steps, state.overflows_left)
        assert floor == any(e.kind == "floor" for e in update.events)


def _hits_floor(state: DynamicScale, found_inf: bool) -> bool:
    return found_inf and state.overflows_left <= 1 and state.scale * state.backoff < state.min


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("config", [NoScale(), StaticScale(128.0)])
def test_fixed_scales_never_move(config: NoScale | StaticScale) -> None:
    state = initial_scale(config)
    for found_inf in (True, False, True):
        assert next_scale(config, state, found_inf, python_where) == (state, False)


def test_running_fields_round_trip_into_the_config() -> None:
    config = DynamicScale(init=256.0, interval=3, hysteresis=2)
    state = config.update(True).state.update(False).state
    fields = initial_scale(state)  # type: ignore[arg-type]
    assert scale_config_with(config, fields) == state


def test_on_floor_raise_is_refused_for_a_compiled_step() -> None:
    with pytest.raises(MixprecError, match="on_floor='warn'"):
        check_traceable(DynamicScale(on_floor="raise"), "jax")
    check_traceable(DynamicScale(), "jax")


def test_growth_stops_below_the_float32_range_even_without_a_ceiling() -> None:
    config = DynamicScale(init=2.0**120, growth=2.0**4, interval=1, max=math.inf)
    state, traced = config, initial_scale(config)
    for _ in range(4):
        state = state.update(False).state
        traced = next_scale(config, traced, False, python_where).state
    assert traced.scale == state.scale == 2.0**124
