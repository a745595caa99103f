"""LossScaler: the shared, mutable holder a backend drives once per step."""

from __future__ import annotations

import json
import math

import pytest

from mixprec.engine.scaler import LossScaler, MixprecState, ScalerCounters
from mixprec.engine.spec import get_policy
from mixprec.errors import CheckpointError, LossScaleError
from mixprec.events import EventLog, ScaleEvent
from mixprec.numerics.loss_scale import DynamicScale, NoScale, StaticScale
from mixprec.numerics.stages import StepTracker


def test_counts_steps_and_skips():
    scaler = LossScaler(DynamicScale(init=8.0, interval=2))
    assert scaler.enabled and scaler.scale == 8.0
    assert [scaler.update(x) for x in (False, True, False, False)] == [False, True, False, False]
    assert scaler.steps == 4 and scaler.skipped_steps == 1
    assert not scaler.last_step_skipped
    assert scaler.scale == 8.0  # backed off to 4, grown back after two finite steps
    assert [(e.step, e.kind) for e in scaler.events] == [(1, "skip"), (1, "backoff"), (3, "growth")]


def test_no_scale_is_disabled_but_still_skips():
    scaler = LossScaler(NoScale())
    assert not scaler.enabled and scaler.scale == 1.0
    assert scaler.update(True) is True
    assert scaler.last_step_skipped and scaler.skipped_steps == 1
    assert scaler.scale == 1.0


def test_two_optimizers_sharing_a_scaler_skip_together():
    scaler = LossScaler(DynamicScale(init=2.0**10, interval=3))
    trackers = {"generator": StepTracker(), "discriminator": StepTracker()}
    stepped: dict[str, int] = {"generator": 0, "discriminator": 0}
    grads_overflow = [False, True, False, False, False, True]
    for found_inf in grads_overflow:
        for tracker in trackers.values():
            tracker.on_backward()
            tracker.on_step()
        # one found_inf for the whole group (reduced over both optimizers' gradients)
        skipped = scaler.update(found_inf)
        for name, tracker in trackers.items():
            if not skipped:
                stepped[name] += 1
            tracker.on_update()
    assert stepped == {"generator": 4, "discriminator": 4}
    assert scaler.skipped_steps == 2 and scaler.steps == 6


def test_events_go_to_a_given_log_and_its_subscribers():
    log = EventLog()
    seen = []
    log.subscribe(seen.append)
    scaler = LossScaler(StaticScale(4.0), events=log)
    scaler.update(False)
    scaler.update(True)
    assert scaler.events is log
    assert [(e.step, e.event) for e in seen] == [(1, ScaleEvent("skip", 4.0, 4.0))]


@pytest.mark.usefixtures("fresh_plugins")
def test_events_reach_the_plugin_hooks():
    from mixprec.engine import plugins
    from mixprec.engine.hookspecs import hookimpl

    calls = []

    class Observer:
        @hookimpl
        def mixprec_scale_event(self, event, step):
            calls.append(("event", event, step))

        @hookimpl
        def mixprec_step_skipped(self, step, loss_scale):
            calls.append(("skip", step, loss_scale))

    plugins.register(Observer(), name="observer")
    scaler = LossScaler(DynamicScale(init=8.0))
    scaler.update(False)
    scaler.update(True)
    assert calls == [
        ("event", ScaleEvent("skip", 8.0, 4.0), 1),
        ("event", ScaleEvent("backoff", 8.0, 4.0), 1),
        ("skip", 1, 8.0),
    ]


def test_state_dict_round_trip_resumes_exactly():
    config = DynamicScale(init=64.0, interval=4, hysteresis=2)
    first = LossScaler(config)
    for found_inf in (False, True, True, False, False):
        first.update(found_inf)
    saved = json.loads(json.dumps(first.state_dict()))
    second = LossScaler(config)
    second.load_state_dict(saved)
    assert second.state == first.state
    assert (second.steps, second.skipped_steps, second.last_step_skipped) == (5, 2, False)
    for found_inf in (False, False, True, False):
        assert first.update(found_inf) == second.update(found_inf)
        assert first.state == second.state


def test_load_refuses_another_kind_and_incomplete_dicts():
    saved = LossScaler(DynamicScale()).state_dict()
    with pytest.raises(CheckpointError, match="'dynamic' but this scaler was configured"):
        LossScaler(NoScale()).load_state_dict(saved)
    with pytest.raises(CheckpointError, match="missing \\['steps'\\]"):
        LossScaler(DynamicScale()).load_state_dict({k: v for k, v in saved.items() if k != "steps"})


# ---------------------------------------------------------------------- issue 21


def _saved(**changed: object) -> dict[str, object]:
    scaler = LossScaler(DynamicScale(init=64.0))
    for found_inf in (False, True, False):
        scaler.update(found_inf)
    return {**scaler.state_dict(), **changed}


@pytest.mark.parametrize("key", ["steps", "skipped_steps"])
@pytest.mark.parametrize(
    "value", [math.inf, -math.inf, math.nan, 1e400, -1, 2.5, True, False, "3", None, [3]]
)
def test_a_malformed_counter_is_refused_before_any_change(key: str, value: object) -> None:
    """An infinite counter escaped as OverflowError; every malformed one is a
    CheckpointError, and the scaler keeps its state."""
    scaler = LossScaler(DynamicScale(init=8.0))
    scaler.update(True)
    before = scaler.state_dict()
    with pytest.raises(CheckpointError, match=r"counter .* is not a non-negative whole number"):
        scaler.load_state_dict(_saved(**{key: value}))
    assert scaler.state_dict() == before


@pytest.mark.parametrize("value", ["no", 2, None, 1.0, [True]])
def test_a_malformed_last_step_skipped_is_refused(value: object) -> None:
    scaler = LossScaler(DynamicScale())
    with pytest.raises(CheckpointError, match="last_step_skipped"):
        scaler.load_state_dict(_saved(last_step_skipped=value))
    assert scaler.steps == 0 and not scaler.last_step_skipped


def test_whole_numbers_load_as_ints_and_zero_is_a_count() -> None:
    scaler = LossScaler(DynamicScale())
    scaler.load_state_dict(_saved(steps=7.0, skipped_steps=0, last_step_skipped=1))
    assert (scaler.steps, scaler.skipped_steps, scaler.last_step_skipped) == (7, 0, True)
    assert type(scaler.steps) is int and scaler.last_step_skipped is True
    scaler.load_state_dict(_saved(last_step_skipped=0))
    assert scaler.last_step_skipped is False


@pytest.mark.parametrize("bad", [5, None, "dynamic", [("kind", "dynamic")]])
def test_a_loss_scale_entry_that_is_no_dict_is_refused(bad: object) -> None:
    with pytest.raises(CheckpointError, match="'loss_scale' must be a dict"):
        LossScaler(DynamicScale()).load_state_dict(_saved(loss_scale=bad))
    with pytest.raises(CheckpointError, match="must be a dict"):
        LossScaler(DynamicScale()).load_state_dict([("steps", 1)])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("key", "value"),
    [("scale", math.inf), ("scale", 10**400), ("good_steps", math.inf), ("kind", ["dynamic"])],
)
def test_a_hostile_loss_scale_state_is_a_checkpoint_error(key: str, value: object) -> None:
    saved = _saved()
    saved["loss_scale"] = {**saved["loss_scale"], key: value}  # type: ignore[dict-item]
    with pytest.raises(CheckpointError):
        LossScaler(DynamicScale()).load_state_dict(saved)


def test_update_counts_and_reports_each_step() -> None:
    scaler = LossScaler(StaticScale(4.0))
    assert (scaler.steps, scaler.skipped_steps, scaler.last_step_skipped) == (0, 0, False)
    assert scaler.update(True) is True
    assert (scaler.steps, scaler.skipped_steps, scaler.last_step_skipped) == (1, 1, True)
    assert scaler.update(False) is False
    assert (scaler.steps, scaler.skipped_steps, scaler.last_step_skipped) == (2, 1, False)
    assert scaler.update(0) is False and scaler.update(1) is True  # a device flag's value
    assert repr(scaler) == (
        "LossScaler(scale=4, steps=4, skipped_steps=2, state=StaticScale(scale=4.0))"
    )


def test_a_floor_that_raises_leaves_the_scaler_as_it_was() -> None:
    scaler = LossScaler(DynamicScale(init=1.0, min=1.0, on_floor="raise"))
    with pytest.raises(LossScaleError):
        scaler.update(True)
    assert (scaler.steps, scaler.skipped_steps, scaler.last_step_skipped) == (0, 0, False)
    assert scaler.scale == 1.0 and len(scaler.events) == 0


def test_snapshot_and_the_counters_mixin_read_the_scaler() -> None:
    class Holder(ScalerCounters):
        def __init__(self) -> None:
            self.scaler = LossScaler(DynamicScale(init=8.0))

    holder = Holder()
    holder.scaler.update(True)
    assert holder.loss_scale == 4.0 and holder.skipped_steps == 1
    assert holder.last_step_skipped is True and holder.events is holder.scaler.events
    policy = get_policy("O2")
    snap = holder.scaler.snapshot(policy)
    assert snap == MixprecState(
        loss_scale=4.0,
        skipped_steps=1,
        last_step_skipped=True,
        steps=1,
        policy=policy,
        events=holder.scaler.events,
    )


def test_a_snapshot_is_an_immutable_value() -> None:
    snap = LossScaler(NoScale()).snapshot(get_policy("O0"))
    with pytest.raises(AttributeError):
        snap.loss_scale = 2.0  # type: ignore[misc]
