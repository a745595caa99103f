"""LossScaler: the one mutable holder of a loss-scale state.

The loss-scale states in :mod:`mixprec.numerics.loss_scale` are immutable values; a backend needs
one place that holds the current state, counts steps and skips, records events and tells
plugins. Optimizers that must skip together (a GAN's generator and discriminator, several
losses of one model) share one :class:`LossScaler`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mixprec.engine.plugins import emit_scale_event, emit_step_skipped
from mixprec.errors import CheckpointError
from mixprec.events import EventLog
from mixprec.numerics.guard import SkipWatch, StepGuard
from mixprec.numerics.loss_scale import LossScale, loss_scale_from_state_dict

if TYPE_CHECKING:
    from mixprec.policy.value import Policy

__all__ = ["LossScaler", "MixprecState", "ScalerCounters"]

_COUNTERS = ("steps", "skipped_steps", "last_step_skipped")


@dataclass(frozen=True)
class MixprecState:
    """A snapshot of one loss scaler, as every backend's ``state(...)`` returns it."""

    loss_scale: float
    """The scale the next backward pass is multiplied by."""
    skipped_steps: int
    """Steps skipped so far because gradients were not finite."""
    last_step_skipped: bool
    """Whether the latest step was skipped."""
    steps: int
    """Steps so far, skipped ones included."""
    policy: Policy
    """The resolved policy (``auto`` already turned into a preset)."""
    events: EventLog
    """The loss-scale event log (skips, backoffs, growths, floor hits)."""


class LossScaler:
    """The current loss scale of a group of optimizers, with step and skip counters.

    A backend's step does, once per iteration of the group: multiply the loss by
    :attr:`scale` (only when :attr:`enabled`), unscale and check the gradients, reduce
    ``found_inf`` across ranks, call :meth:`update` and skip the optimizer step when it
    returns True. Events go to :attr:`events` and to the ``mixprec_scale_event`` and
    ``mixprec_step_skipped`` plugin hooks.
    """

    def __init__(
        self, config: LossScale, events: EventLog | None = None, guard: StepGuard | None = None
    ) -> None:
        self.state: LossScale = config
        self.events: EventLog = EventLog() if events is None else events
        self.steps = 0
        """Updates so far, skipped ones included (the 0-based index of the next step)."""
        self.skipped_steps = 0
        """How many of those steps were skipped because gradients were not finite."""
        self.last_step_skipped = False
        """Whether the latest update skipped its step."""
        self.watch = SkipWatch(guard)
        """Counts skips in a row and warns every ``guard.warn_after`` of them."""

    @property
    def scale(self) -> float:
        """The scale the current step multiplies the loss by."""
        return self.state.scale

    @property
    def enabled(self) -> bool:
        """Whether the backend must scale the loss and unscale gradients (False for NoScale).

        Overflow checks are still wanted when it is False: an overflow skips the step.
        """
        return self.state.enabled

    def update(
        self, found_inf: bool, overflowing: Sequence[str] = (), rank: int | None = None
    ) -> bool:
        """Advance the state by one step; return True when that step must be skipped.

        ``found_inf`` (a gradient was inf/NaN or the squared gradient norm overflowed
        float32, see :mod:`mixprec.numerics.guard`) must already be reduced across every rank and
        every optimizer of the group, so they all skip together. ``overflowing`` names the
        parameters that overflowed, and ``rank`` this process's rank in a run of several ranks
        (None in a run of one), for the repeated-skip warning (:attr:`watch`). A
        :class:`~mixprec.errors.LossScaleError` from a ``DynamicScale(on_floor="raise")`` at
        its floor propagates and leaves the scaler as it was before the call.
        """
        step = self.steps
        ran_with = self.state.scale
        result = self.state.update(found_inf)
        self.state = result.state
        self.steps = step + 1
        skipped = bool(found_inf)
        self.last_step_skipped = skipped
        if skipped:
            self.skipped_steps += 1
        if result.events:
            # Events are rare, and these functions do nothing unless a plugin implements
            # the hook: plugin machinery stays off the hot path.
            for event in result.events:
                self.events.record(step, event)
                emit_scale_event(event, step)
            if skipped:
                emit_step_skipped(step, ran_with)
        self.watch.observe(step, skipped, overflowing, f"loss scale {ran_with:g}", rank)
        return skipped

    def state_dict(self) -> dict[str, Any]:
        """The loss-scale state and the counters, as plain Python values."""
        return {
            "loss_scale": self.state.state_dict(),
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "last_step_skipped": self.last_step_skipped,
        }

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, exactly (the event log is not saved).

        The saved state replaces the configured one, so a resumed run continues with the
        scale, counters and configuration it was saved with. Loading a different kind of
        loss scale (say a dynamic scale into a scaler configured without scaling) raises
        :class:`~mixprec.errors.CheckpointError`.
        """
        if not isinstance(d, Mapping):
            raise CheckpointError(
                f"loss-scaler state must be a dict, got {type(d).__name__}; pass what "
                "LossScaler.state_dict() returned"
            )
        missing = [key for key in ("loss_scale", *_COUNTERS) if key not in d]
        if missing:
            raise CheckpointError(
                f"loss-scaler state is missing {missing}; pass what LossScaler.state_dict() "
                "returned (mixprec saves it inside the optimizer's state dict)"
            )
        # everything is checked and converted before the scaler changes
        if not isinstance(d["loss_scale"], Mapping):
            raise CheckpointError(
                f"loss-scaler state's 'loss_scale' must be a dict, got "
                f"{type(d['loss_scale']).__name__}; pass what LossScaler.state_dict() returned"
            )
        try:
            state = loss_scale_from_state_dict(d["loss_scale"])
            steps, skipped = _count(d["steps"]), _count(d["skipped_steps"])
            last = _flag(d["last_step_skipped"])
        except (TypeError, ValueError) as err:
            raise CheckpointError(
                f"loss-scaler state is malformed ({err}); pass what LossScaler.state_dict() "
                "returned"
            ) from err
        if state.kind != self.state.kind:
            raise CheckpointError(
                f"the checkpoint's loss scale is {state.kind!r} but this scaler was configured "
                f"with {self.state.kind!r}; wrap the model with the policy the checkpoint was "
                "saved with (its loss_scale setting) before loading"
            )
        self.state = state
        self.steps = steps
        self.skipped_steps = skipped
        self.last_step_skipped = last

    def snapshot(self, policy: Policy) -> MixprecState:
        """This scaler's counters and events, with the ``policy`` they run under."""
        return MixprecState(
            loss_scale=self.scale,
            skipped_steps=self.skipped_steps,
            last_step_skipped=self.last_step_skipped,
            steps=self.steps,
            policy=policy,
            events=self.events,
        )

    def __repr__(self) -> str:
        return (
            f"LossScaler(scale={self.scale:g}, steps={self.steps}, "
            f"skipped_steps={self.skipped_steps}, state={self.state!r})"
        )


class ScalerCounters:
    """Mixin for a backend object that holds a :class:`LossScaler` as ``self.scaler``: the
    read-only ``loss_scale``, ``skipped_steps``, ``last_step_skipped`` and ``events`` users
    expect on a trainer (``trainer.skipped_steps``)."""

    scaler: LossScaler

    @property
    def loss_scale(self) -> float:
        """The scale the next scaled backward pass multiplies the loss by."""
        return self.scaler.scale

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far because a gradient was inf or NaN."""
        return self.scaler.skipped_steps

    @property
    def last_step_skipped(self) -> bool:
        """Whether the latest step was skipped."""
        return self.scaler.last_step_skipped

    @property
    def events(self) -> EventLog:
        """The record of skips and scale changes."""
        return self.scaler.events


def _count(value: Any) -> int:
    """A saved counter as an int; anything but a non-negative whole number (an inf, a NaN, a
    fraction, a bool, a string) is malformed."""
    try:
        whole = not isinstance(value, bool) and int(value) == value and value >= 0
    except (TypeError, ValueError, OverflowError):  # None, "3", inf, NaN
        whole = False
    if not whole:
        raise ValueError(f"counter {value!r} is not a non-negative whole number")
    return int(value)


def _flag(value: Any) -> bool:
    """A saved flag as a bool; anything but a bool (or 0 and 1) is malformed."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"last_step_skipped {value!r} is not True or False")
