"""The loss-scale state machines against independent references."""

from __future__ import annotations

import json
import math
import struct
import warnings
from dataclasses import fields

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mixprec.errors import CheckpointError, LossScaleError, MixprecWarning, PolicyError
from mixprec.events import ScaleEvent
from mixprec.numerics.loss_scale import (
    DynamicScale,
    LossScale,
    NoScale,
    StaticScale,
    loss_scale_from_state_dict,
)

overflows = st.lists(st.booleans(), max_size=300)
# sequences that overflow in bursts as well as at random
bursty = st.lists(
    st.tuples(st.booleans(), st.integers(1, 12)).map(lambda t: [t[0]] * t[1]), max_size=40
).map(lambda runs: [x for run in runs for x in run])


def run(state: LossScale, seq: list[bool]) -> tuple[list[float], list[tuple[str, ...]]]:
    """The scale used on each step after the first, and each step's event kinds."""
    scales, kinds = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MixprecWarning)
        for found_inf in seq:
            state, events = state.update(found_inf)
            scales.append(state.scale)
            kinds.append(tuple(e.kind for e in events))
    return scales, kinds


def megatron_reference(
    seq: list[bool],
    *,
    init: float,
    growth: float,
    backoff: float,
    interval: int,
    hysteresis: int,
    lo: float,
    hi: float,
) -> tuple[list[float], list[tuple[str, ...]]]:
    """Megatron-LM's DynamicGradScaler.update, transcribed, with a ceiling and floor events."""
    scale, growth_tracker, hysteresis_tracker = init, 0, hysteresis
    scales, kinds = [], []
    for found_inf in seq:
        before = scale
        if found_inf:
            growth_tracker = 0
            hysteresis_tracker -= 1
            kind: tuple[str, ...] = ("skip",)
            if hysteresis_tracker <= 0:
                if scale * backoff < lo:
                    kind, scale = ("skip", "floor"), lo
                else:
                    kind, scale = ("skip", "backoff"), scale * backoff
        else:
            growth_tracker += 1
            kind = ()
            if growth_tracker == interval:
                growth_tracker = 0
                hysteresis_tracker = hysteresis
                scale = min(scale * growth, hi)
                kind = ("growth",) if scale != before else ()
        scales.append(scale)
        kinds.append(kind)
    return scales, kinds


#: The largest float32: GradScaler's scale is a float32 tensor.
FLOAT32_MAX = struct.unpack("<f", b"\xff\xff\x7f\x7f")[0]


def grad_scaler_reference(
    seq: list[bool], *, init: float, growth: float, backoff: float, interval: int
) -> list[float]:
    """torch.amp.GradScaler's update (the _amp_update_scale_ kernel), transcribed.

    The kernel grows only when ``scale * growth`` is finite *in float32*, the scale's dtype:
    the product is compared with float32's largest value, not tested in float64 (which let
    the reference grow past float32 after 56 finite steps at growth 4, where mixprec and
    the kernel stop)."""
    scale, tracker, out = init, 0, []
    for found_inf in seq:
        if found_inf:
            scale, tracker = scale * backoff, 0
        else:
            tracker += 1
            if tracker == interval:
                if scale * growth <= FLOAT32_MAX:
                    scale *= growth
                tracker = 0
        out.append(scale)
    return out


@settings(max_examples=300, deadline=None)
@given(
    seq=st.one_of(overflows, bursty),
    init_exp=st.integers(0, 20),
    growth=st.sampled_from([2.0, 4.0, 1.5]),
    backoff=st.sampled_from([0.5, 0.25, 0.75]),
    interval=st.integers(1, 6),
    hysteresis=st.integers(1, 4),
    lo_exp=st.integers(-4, 8),
    hi_exp=st.integers(20, 26),
)
def test_dynamic_matches_megatron_reference(
    seq, init_exp, growth, backoff, interval, hysteresis, lo_exp, hi_exp
):
    lo = 2.0 ** min(lo_exp, init_exp)
    hi = 2.0**hi_exp
    state = DynamicScale(
        init=2.0**init_exp,
        growth=growth,
        backoff=backoff,
        interval=interval,
        hysteresis=hysteresis,
        min=lo,
        max=hi,
    )
    expected = megatron_reference(
        seq,
        init=2.0**init_exp,
        growth=growth,
        backoff=backoff,
        interval=interval,
        hysteresis=hysteresis,
        lo=lo,
        hi=hi,
    )
    assert run(state, seq) == expected


@settings(max_examples=300, deadline=None)
@given(
    seq=st.one_of(overflows, bursty),
    growth=st.sampled_from([2.0, 4.0, 1.5, 1.001]),
    backoff=st.sampled_from([0.5, 0.25, 0.75, 0.999]),
    interval=st.integers(1, 50),
)
@example(seq=[False] * 56, growth=4.0, backoff=0.5, interval=1)  # past float32 (issue 21)
def test_hysteresis_one_matches_grad_scaler(seq, growth, backoff, interval):
    # floor and ceiling far out of reach: min below anything 300 backoffs reach, no max
    state = DynamicScale(
        growth=growth, backoff=backoff, interval=interval, min=2.0**-1000, max=math.inf
    )
    scales, _ = run(state, seq)
    expected = grad_scaler_reference(
        seq, init=2.0**16, growth=growth, backoff=backoff, interval=interval
    )
    assert scales == expected


@pytest.mark.torch
@settings(max_examples=50, deadline=None)
@given(seq=st.lists(st.booleans(), max_size=100), interval=st.integers(1, 5))
def test_hysteresis_one_matches_torch_kernel(seq, interval):
    torch = pytest.importorskip("torch")
    scale = torch.tensor([2.0**16])
    tracker = torch.tensor([0], dtype=torch.int32)
    expected = []
    for found_inf in seq:
        torch._amp_update_scale_(
            scale, tracker, torch.tensor([float(found_inf)]), 2.0, 0.5, interval
        )
        expected.append(scale.item())
    scales, _ = run(DynamicScale(interval=interval, min=2.0**-100, max=math.inf), seq)
    assert scales == expected


def test_new_scale_is_used_on_the_very_next_step():
    state = DynamicScale(init=8.0, interval=3)
    state = state.update(False).state.update(False).state
    assert state.scale == 8.0
    grown = state.update(False)  # third finite step in a row
    assert grown.state.scale == 16.0 and grown.state.good_steps == 0
    assert grown.events == (ScaleEvent("growth", 8.0, 16.0),)
    backed = grown.state.update(True)
    assert backed.state.scale == 8.0
    assert [e.kind for e in backed.events] == ["skip", "backoff"]


def test_overflow_resets_the_growth_counter():
    state = DynamicScale(init=8.0, interval=3)
    for found_inf in (False, False, True, False, False):
        state = state.update(found_inf).state
    assert state.scale == 4.0 and state.good_steps == 2


def test_hysteresis_tolerates_h_minus_1_overflows_and_refills_only_on_growth():
    state = DynamicScale(init=64.0, interval=2, hysteresis=3)
    scales, kinds = run(state, [True, True, True, True, False, True, False, False, True])
    assert scales == [64.0, 64.0, 32.0, 16.0, 16.0, 8.0, 8.0, 16.0, 16.0]
    assert kinds[:3] == [("skip",), ("skip",), ("skip", "backoff")]
    assert kinds[7] == ("growth",) and kinds[8] == ("skip",)  # refilled by the growth


def test_ceiling_caps_growth_without_an_event_once_reached():
    state = DynamicScale(init=12.0, max=16.0, interval=1)
    scales, kinds = run(state, [False, False])
    assert scales == [16.0, 16.0]
    assert kinds == [("growth",), ()]


def test_floor_warns_once_per_hit_and_clamps():
    state = DynamicScale(init=2.0, min=1.5)
    with pytest.warns(MixprecWarning, match="forward pass") as caught:
        update = state.update(True)
    assert len(caught) == 1
    assert update.state.scale == 1.5
    assert update.events == (ScaleEvent("skip", 2.0, 1.5), ScaleEvent("floor", 2.0, 1.5))
    with pytest.warns(MixprecWarning):
        again = update.state.update(True)
    assert again.state.scale == 1.5
    assert [e.kind for e in again.events] == ["skip", "floor"]


def test_floor_raise_names_the_cause_and_the_fix():
    state = DynamicScale(init=1.0, on_floor="raise")
    with pytest.raises(LossScaleError, match="forward pass") as err:
        state.update(True)
    assert "float32" in str(err.value) and "on_floor='warn'" in str(err.value)


@pytest.mark.parametrize("state", [NoScale(), StaticScale(128.0)])
def test_fixed_scales_skip_on_overflow_without_changing(state):
    update = state.update(True)
    assert update.state == state
    assert update.events == (ScaleEvent("skip", state.scale, state.scale),)
    assert state.update(False) == (state, ())


def test_enabled():
    assert not NoScale().enabled
    assert StaticScale(1.0).enabled and DynamicScale().enabled
    assert NoScale().scale == 1.0


def test_running_fields_default_from_the_config():
    state = DynamicScale(init=1024.0, hysteresis=3)
    assert (state.scale, state.good_steps, state.overflows_left) == (1024.0, 0, 3)


@settings(max_examples=100, deadline=None)
@given(
    seq=st.lists(st.booleans(), min_size=1, max_size=40),
    interval=st.integers(2, 9),
    hysteresis=st.integers(1, 3),
)
def test_every_field_survives_state_dict_mid_interval(seq, interval, hysteresis):
    config = DynamicScale(
        init=2.0**10,
        growth=3.0,
        backoff=0.25,
        interval=interval,
        hysteresis=hysteresis,
        min=0.5,
        max=2.0**30,
        on_floor="warn",
    )
    state = config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MixprecWarning)
        for found_inf in seq:
            state = state.update(found_inf).state
    d = json.loads(json.dumps(state.state_dict()))  # what a checkpoint file would hold
    restored = loss_scale_from_state_dict(d)
    assert restored == state
    for f in fields(DynamicScale):
        assert getattr(restored, f.name) == getattr(state, f.name), f.name
    assert set(d) == {"kind"} | {f.name for f in fields(DynamicScale)}
    # and the restored state continues exactly like the original
    assert run(restored, seq) == run(state, seq)


def test_state_dict_covers_non_default_config_fields():
    state = DynamicScale(
        init=3.0, growth=1.5, backoff=0.9, interval=7, hysteresis=2, min=0.25, max=96.0,
        on_floor="raise", scale=6.0, good_steps=5, overflows_left=1,
    )  # fmt: skip
    assert loss_scale_from_state_dict(state.state_dict()) == state


@pytest.mark.parametrize("state", [NoScale(), StaticScale(4096.0), DynamicScale()])
def test_every_kind_round_trips(state):
    restored = loss_scale_from_state_dict(state.state_dict())
    assert type(restored) is type(state) and restored == state


def test_bad_state_dicts_raise_checkpoint_error():
    with pytest.raises(CheckpointError, match="unknown loss-scale kind"):
        loss_scale_from_state_dict({"kind": "adaptive"})
    d = DynamicScale().state_dict()
    del d["min"]
    with pytest.raises(CheckpointError, match="missing \\['min'\\]"):
        loss_scale_from_state_dict(d)
    d = DynamicScale().state_dict() | {"good_steps": 5000}
    with pytest.raises(CheckpointError, match="good_steps"):
        loss_scale_from_state_dict(d)


def test_fresh_resets_running_fields_and_keeps_the_config():
    state = DynamicScale(init=64.0, interval=3, hysteresis=2)
    for found_inf in (True, True, False, False):
        state = state.update(found_inf).state
    assert state != DynamicScale(init=64.0, interval=3, hysteresis=2)
    assert state.fresh() == DynamicScale(init=64.0, interval=3, hysteresis=2)
    assert state.config() == state.fresh()
    assert StaticScale(8.0).fresh() == StaticScale(8.0) and NoScale().fresh() == NoScale()


def test_states_are_hashable_values():
    assert hash(DynamicScale()) == hash(DynamicScale())
    assert len({NoScale(), NoScale(), StaticScale(2.0), StaticScale(2)}) == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"growth": 0.5}, "growth must be >= 1"),
        ({"refill": "never"}, "refill must be 'growth' or 'finite'"),
        ({"skip": "all"}, "skip must be 'group' or 'optimizer'"),
        ({"init": 1e39, "max": math.inf}, "min <= init <= max"),
        ({"backoff": 1.0}, "backoff must be between 0 and 1"),
        ({"backoff": 0.0}, "backoff must be a positive"),
        ({"interval": 0}, "interval must be >= 1"),
        ({"interval": 2.5}, "interval must be an integer"),
        ({"hysteresis": 0}, "hysteresis must be >= 1"),
        ({"min": 0.0}, "min must be a positive"),
        ({"init": 2.0**30}, "min <= init <= max"),
        ({"init": 0.5}, "min <= init <= max"),
        ({"init": math.nan}, "init must be a positive finite"),
        ({"on_floor": "ignore"}, "on_floor must be 'warn' or 'raise'"),
        ({"scale": 2.0**30}, "outside"),
        ({"overflows_left": 2}, "exceeds hysteresis"),
    ],
)
def test_dynamic_rejects_bad_arguments_with_the_fix(kwargs, match):
    with pytest.raises(PolicyError, match=match):
        DynamicScale(**kwargs)


@pytest.mark.parametrize("scale", [0.0, -1.0, math.inf, "big"])
def test_static_rejects_bad_scale(scale):
    with pytest.raises(PolicyError, match="StaticScale"):
        StaticScale(scale)


def test_all_kinds_satisfy_the_protocol():
    for state in (NoScale(), StaticScale(2.0), DynamicScale()):
        assert isinstance(state, LossScale)


def test_a_scale_without_ceiling_stays_inside_float32() -> None:
    # max=inf used to grow past float32 (1.6e39), where every scaled float32 loss is inf
    state = DynamicScale(init=2.0**120, max=math.inf, interval=1)
    for _ in range(20):
        state = state.update(False).state
    assert state.scale == 2.0**127  # the last power of two below float32's max
    struct.pack("f", state.scale)  # representable in float32 (raises OverflowError if not)


def test_refill_finite_is_apex_hysteresis_and_growth_refill_is_megatron() -> None:
    def scales(refill: str) -> list[float]:
        state = DynamicScale(init=1024.0, hysteresis=2, refill=refill)  # type: ignore[arg-type]
        out = []
        for found_inf in (True, False, True, False, True):  # never two overflows in a row
            state = state.update(found_inf).state
            out.append(state.scale)
        return out

    # apex: a finite step refills the tolerance, so isolated overflows never back off
    assert scales("finite") == [1024.0] * 5
    # core default: the tolerance is spent until the scale grows again
    assert scales("growth") == [1024.0, 1024.0, 512.0, 512.0, 256.0]


def test_growth_one_is_a_scale_that_only_backs_off() -> None:
    state = DynamicScale(init=8.0, growth=1.0, interval=1)
    state = state.update(True).state
    for _ in range(5):
        update = state.update(False)
        assert update.events == ()
        state = update.state
    assert state.scale == 4.0


def test_checkpoints_saved_before_refill_and_skip_still_load() -> None:
    saved = DynamicScale(init=64.0).state_dict()
    del saved["refill"], saved["skip"]
    assert loss_scale_from_state_dict(saved) == DynamicScale(init=64.0)


def test_refill_and_skip_are_policy_settings_that_round_trip() -> None:
    from mixprec.engine.spec import get_policy

    policy = get_policy("O2", loss_scale="dynamic(skip=optimizer,refill=finite)")
    assert (policy.loss_scale.skip, policy.loss_scale.refill) == ("optimizer", "finite")
    assert "skip=optimizer" in str(policy)
    assert get_policy(str(policy)) == policy
    assert get_policy(policy.to_dict()) == policy


# ---------------------------------------------------------------------- issue 21: mutants


def test_the_documented_defaults() -> None:
    """help(DynamicScale) and DESIGN.md: init 2**16, growth 2, backoff 0.5, interval 2000,
    hysteresis 1, min 1, max 2**24, warn at the floor, refill on growth, the group skips."""
    state = DynamicScale()
    assert (state.init, state.growth, state.backoff, state.interval) == (65536.0, 2.0, 0.5, 2000)
    assert (state.hysteresis, state.min, state.max) == (1, 1.0, 16777216.0)
    assert (state.on_floor, state.refill, state.skip) == ("warn", "growth", "group")
    assert (state.scale, state.good_steps, state.overflows_left) == (65536.0, 0, 1)
    assert [type(v) for v in (state.init, state.interval)] == [float, int]


def test_a_backoff_landing_exactly_on_min_is_a_backoff_not_the_floor() -> None:
    state = DynamicScale(init=4.0, min=2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no floor warning
        update = state.update(True)
    assert update.state.scale == 2.0
    assert update.events == (ScaleEvent("skip", 4.0, 2.0), ScaleEvent("backoff", 4.0, 2.0))
    assert update.state.overflows_left == 1 and update.state.good_steps == 0


def test_a_growth_landing_exactly_on_max_grows_and_then_stays() -> None:
    state = DynamicScale(init=8.0, max=16.0, interval=2)
    scales, kinds = run(state, [False, False, False, False])
    assert scales == [8.0, 16.0, 16.0, 16.0]
    assert kinds == [(), ("growth",), (), ()]


def test_a_scale_exactly_at_min_or_max_loads_and_one_beyond_is_refused() -> None:
    assert DynamicScale(min=2.0, max=8.0, init=4.0, scale=2.0).scale == 2.0
    assert DynamicScale(min=2.0, max=8.0, init=4.0, scale=8.0).scale == 8.0
    assert DynamicScale(min=2.0, max=8.0, init=2.0).init == 2.0
    assert DynamicScale(min=2.0, max=8.0, init=8.0).init == 8.0
    for bad in (1.999, 8.001):
        with pytest.raises(PolicyError, match="outside"):
            DynamicScale(min=2.0, max=8.0, init=4.0, scale=bad)


def test_good_steps_must_stay_below_interval() -> None:
    assert DynamicScale(interval=3, good_steps=2).good_steps == 2
    with pytest.raises(PolicyError, match="good_steps=3 must be below interval=3"):
        DynamicScale(interval=3, good_steps=3)
    with pytest.raises(PolicyError, match="good_steps"):
        DynamicScale(good_steps=-1)


def test_the_interval_th_finite_step_grows_and_restarts_the_count() -> None:
    state = DynamicScale(init=8.0, interval=3, hysteresis=2, overflows_left=1)
    once = state.update(False).state
    assert (once.scale, once.good_steps, once.overflows_left) == (8.0, 1, 1)
    grown = once.update(False).state.update(False).state
    assert (grown.scale, grown.good_steps, grown.overflows_left) == (16.0, 0, 2)


def test_refill_finite_refills_on_every_finite_step() -> None:
    state = DynamicScale(hysteresis=3, refill="finite", overflows_left=1)
    assert state.update(False).state.overflows_left == 3
    assert DynamicScale(hysteresis=3, overflows_left=1).update(False).state.overflows_left == 1


def test_overflows_left_is_checked_against_hysteresis() -> None:
    assert DynamicScale(hysteresis=2, overflows_left=2).overflows_left == 2
    assert DynamicScale(hysteresis=2, overflows_left=1).overflows_left == 1
    with pytest.raises(PolicyError, match="exceeds hysteresis"):
        DynamicScale(hysteresis=2, overflows_left=3)
    with pytest.raises(PolicyError, match="overflows_left"):
        DynamicScale(hysteresis=2, overflows_left=0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"growth": 1.0},
        {"backoff": 0.999},
        {"interval": 1},
        {"hysteresis": 1},
        {"min": 65536.0},
        {"max": 65536.0},
        {"max": math.inf},
        {"on_floor": "raise"},
        {"skip": "optimizer"},
    ],
)
def test_boundary_arguments_are_accepted(kwargs: dict[str, object]) -> None:
    state = DynamicScale(**kwargs)  # type: ignore[arg-type]
    for key, value in kwargs.items():
        assert getattr(state, key) == value


@pytest.mark.parametrize(
    "kwargs",
    [
        {"growth": 0.999},
        {"backoff": 1.0},
        {"backoff": 0.0},
        {"interval": 0},
        {"hysteresis": 0},
        {"interval": True},
        {"init": True},
        {"init": 10**400},
        {"max": -math.inf},
        {"min": 0.0},
    ],
)
def test_just_outside_arguments_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(PolicyError):
        DynamicScale(**kwargs)  # type: ignore[arg-type]


def test_fresh_and_config_restart_at_init() -> None:
    state = DynamicScale(init=8.0, interval=4, hysteresis=3).update(True).state
    state = state.update(False).state
    for fresh in (state.fresh(), state.config()):
        assert (fresh.scale, fresh.good_steps, fresh.overflows_left) == (8.0, 0, 3)
    assert NoScale().fresh() == NoScale() and StaticScale(2.0).config() == StaticScale(2.0)


def test_state_dict_of_every_kind_names_it() -> None:
    assert NoScale().state_dict() == {"kind": "none"}
    assert StaticScale(2.0).state_dict() == {"kind": "static", "scale": 2.0}
    saved = DynamicScale(init=8.0).state_dict()
    assert saved["kind"] == "dynamic" and saved["scale"] == 8.0 and saved["good_steps"] == 0
    with pytest.raises(CheckpointError, match="unknown loss-scale kind"):
        loss_scale_from_state_dict({**saved, "kind": ["dynamic"]})
    with pytest.raises(CheckpointError, match="missing \\['init'\\], unexpected \\['x'\\]"):
        loss_scale_from_state_dict({**{k: v for k, v in saved.items() if k != "init"}, "x": 1})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"init": "x"}, r"DynamicScale init must be a positive finite number, got 'x'; see help"),
        ({"growth": "x"}, r"DynamicScale growth must be a positive finite number.*see help"),
        ({"growth": 0.5}, r"DynamicScale growth must be >= 1, got 0\.5; try 2\.0"),
        ({"backoff": "x"}, r"DynamicScale backoff must be a positive finite number.*see help"),
        ({"backoff": 2.0}, r"backoff must be between 0 and 1, got 2\.0; try 0\.5"),
        ({"interval": 0}, r"DynamicScale interval must be >= 1, got 0; try 2000"),
        ({"interval": "x"}, r"DynamicScale interval must be an integer, got 'x'; try 2000"),
        ({"hysteresis": 0}, r"DynamicScale hysteresis must be >= 1, got 0; 1 means no tolerance"),
        ({"min": "x"}, r"DynamicScale min must be a positive finite number.*see help"),
        ({"max": "x"}, r"DynamicScale max must be a positive finite number.*math\.inf"),
        ({"scale": "x"}, r"DynamicScale scale must be a positive finite number.*see help"),
        ({"scale": 2.0**30}, r"scale=1073741824\.0 lies outside \[min, max\].*leave scale unset"),
        ({"good_steps": -1}, r"DynamicScale good_steps must be >= 0, got -1; leave it at 0"),
        ({"overflows_left": 0}, r"DynamicScale overflows_left must be >= 1.*leave it unset"),
        ({"overflows_left": 2}, r"overflows_left=2 exceeds hysteresis=1; leave it unset"),
    ],
)
def test_each_bad_argument_is_named_with_its_fix(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(PolicyError, match=match):
        DynamicScale(**kwargs)  # type: ignore[arg-type]


def test_a_bad_static_scale_names_the_class_and_the_fix() -> None:
    with pytest.raises(PolicyError, match=r"StaticScale\.scale must be .*StaticScale\(1024\.0\)"):
        StaticScale(0.0)


class _Index:
    """An integer of another library (numpy.int64 and friends)."""

    def __index__(self) -> int:
        return 3


def test_arguments_are_stored_as_floats_and_ints() -> None:
    state = DynamicScale(
        init=8, growth=4, backoff=_Half(), interval=_Index(), hysteresis=_Index(), min=2, max=64
    )  # type: ignore[arg-type]
    floats = [getattr(state, k) for k in ("init", "growth", "min", "max")]
    assert floats == [8.0, 4.0, 2.0, 64.0] and {type(v) for v in floats} == {float}
    assert (type(state.backoff), state.backoff) == (float, 0.5)
    assert [type(getattr(state, k)) for k in ("interval", "hysteresis", "overflows_left")] == [
        int, int, int
    ]  # fmt: skip
    assert (state.interval, state.hysteresis, state.scale, type(state.scale)) == (3, 3, 8.0, float)
    moved = DynamicScale(init=8, scale=16, good_steps=_Index(), interval=4, overflows_left=1)  # type: ignore[arg-type]
    assert (type(moved.scale), moved.scale, type(moved.good_steps), moved.good_steps) == (
        float, 16.0, int, 3
    )  # fmt: skip
    left = DynamicScale(hysteresis=4, overflows_left=_Index())  # type: ignore[arg-type]
    assert (type(left.overflows_left), left.overflows_left) == (int, 3)
    assert type(StaticScale(4).scale) is float  # type: ignore[arg-type]


class _Half:
    def __float__(self) -> float:
        return 0.5


def test_no_scale_is_disabled_and_the_others_enabled_exactly() -> None:
    assert NoScale().enabled is False and StaticScale(2.0).enabled is True
    assert DynamicScale().enabled is True and NoScale().scale == 1.0


def test_a_scale_may_grow_to_exactly_float32s_largest() -> None:
    state = DynamicScale(init=2.0**126, growth=4.0, interval=1, max=FLOAT32_MAX)
    assert state.update(False).state.scale == FLOAT32_MAX
    at_top = DynamicScale(init=FLOAT32_MAX, interval=1, max=math.inf)
    assert at_top.update(False) == (at_top.update(False).state, ())  # stays, no event


def test_the_floor_warning_points_at_the_caller_of_update() -> None:
    with pytest.warns(MixprecWarning) as caught:
        DynamicScale(init=2.0, min=1.5).update(True)
    assert caught[0].filename == __file__
