"""Loss scaling as pure state machines: no tensors, no frameworks.

Each loss scale is a frozen value. ``state.update(found_inf)`` returns a
:class:`ScaleUpdate` holding the *next* state and the :class:`~mixprec.events.ScaleEvent`\\ s
of this step; the state itself never changes. A backend multiplies the loss by
``state.scale``, divides the gradients by it, tells the state whether any gradient was
inf/NaN, and uses the returned state's scale on the very next step.

Every field, configuration and running, round-trips through ``state_dict()`` and
:func:`loss_scale_from_state_dict`.
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal, NamedTuple, Protocol, runtime_checkable

from mixprec.errors import CheckpointError, LossScaleError, MixprecWarning, PolicyError
from mixprec.events import ScaleEvent

__all__ = [
    "LOSS_SCALE_KINDS",
    "DynamicScale",
    "LossScale",
    "LossScaleConfig",
    "NoScale",
    "ScaleUpdate",
    "StaticScale",
    "loss_scale_from_state_dict",
]

_NO_EVENTS: tuple[ScaleEvent, ...] = ()
#: The largest float32: a scale above it would turn a finite float32 loss into inf.
FLOAT32_MAX = 3.4028234663852886e38


class ScaleUpdate(NamedTuple):
    """What one ``update(found_inf)`` produced: the next state and this step's events."""

    state: LossScale
    events: tuple[ScaleEvent, ...]


@runtime_checkable
class LossScale(Protocol):
    """What every loss scale offers (see :class:`NoScale`, :class:`StaticScale`,
    :class:`DynamicScale`)."""

    kind: ClassVar[str]

    @property
    def scale(self) -> float:
        """The factor the loss is multiplied by on this step."""
        ...

    @property
    def enabled(self) -> bool:
        """Whether the backend has to scale the loss and unscale the gradients at all."""
        ...

    def update(self, found_inf: bool) -> ScaleUpdate:
        """The state for the next step, given whether this step's gradients overflowed."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Every field, for :func:`loss_scale_from_state_dict`."""
        ...

    def fresh(self) -> LossScale:
        """The same configuration with the running fields reset."""
        ...

    def config(self) -> LossScale:
        """Alias of :meth:`fresh`."""
        ...


def _positive_finite(name: str, value: object, fix: str) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int beyond float
        number = math.nan
    if isinstance(value, bool) or not (math.isfinite(number) and number > 0):
        shown = repr(value)
        if isinstance(value, int) and len(shown) > 40:
            shown = f"an integer of {len(shown)} digits"
        raise PolicyError(f"{name} must be a positive finite number, got {shown}; {fix}")
    return number


def _count(name: str, value: object, low: int, fix: str) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise PolicyError(f"{name} must be an integer, got {value!r}; {fix}") from None
    if number < low:
        raise PolicyError(f"{name} must be >= {low}, got {value!r}; {fix}")
    return number


@dataclass(frozen=True)
class NoScale:
    """No loss scaling: the scale is always 1.0.

    Gradients are not scaled, but an overflow reported by the backend still skips the step
    (a ``"skip"`` event) so inf/NaN never reaches the weights. The state never changes.
    """

    kind: ClassVar[str] = "none"

    @property
    def scale(self) -> float:
        """Always 1.0."""
        return 1.0

    @property
    def enabled(self) -> bool:
        """False: there is nothing to multiply or divide."""
        return False

    def update(self, found_inf: bool) -> ScaleUpdate:
        """Skip on overflow; the scale stays 1.0."""
        if found_inf:
            return ScaleUpdate(self, (ScaleEvent("skip", 1.0, 1.0),))
        return ScaleUpdate(self, _NO_EVENTS)

    def state_dict(self) -> dict[str, Any]:
        """``{"kind": "none"}``."""
        return {"kind": self.kind}

    def fresh(self) -> NoScale:
        """Itself: there is no running state."""
        return self

    config = fresh


@dataclass(frozen=True)
class StaticScale:
    """A fixed loss scale: multiply the loss by ``scale`` on every step.

    An overflow skips the step (a ``"skip"`` event) and leaves the scale unchanged.
    """

    scale: float
    kind: ClassVar[str] = "static"

    def __post_init__(self) -> None:
        fix = "pass a value such as StaticScale(1024.0), or use DynamicScale()"
        object.__setattr__(self, "scale", _positive_finite("StaticScale.scale", self.scale, fix))

    @property
    def enabled(self) -> bool:
        """True: the loss is scaled by ``scale``."""
        return True

    def update(self, found_inf: bool) -> ScaleUpdate:
        """Skip on overflow; the scale never changes."""
        if found_inf:
            return ScaleUpdate(self, (ScaleEvent("skip", self.scale, self.scale),))
        return ScaleUpdate(self, _NO_EVENTS)

    def state_dict(self) -> dict[str, Any]:
        """``{"kind": "static", "scale": ...}``."""
        return {"kind": self.kind, "scale": self.scale}

    def fresh(self) -> StaticScale:
        """Itself: there is no running state."""
        return self

    config = fresh


@dataclass(frozen=True)
class DynamicScale:
    """A loss scale that finds the largest value that keeps gradients finite.

    Configuration: ``init`` (starting scale), ``growth`` (>= 1; 1.0 is a scale that only
    backs off), ``backoff`` (in (0, 1)), ``interval`` (finite steps in a row before growing),
    ``hysteresis`` (overflows it takes to back off), ``refill`` (when that tolerance refills:
    ``"growth"`` or ``"finite"``, below), ``min``/``max`` (floor and ceiling; the scale never
    exceeds the float32 range, even with ``max=math.inf``), ``on_floor`` (``"warn"`` or
    ``"raise"``), ``skip`` (who skips on an overflow: ``"group"``, every optimizer of the
    round, or ``"optimizer"``, only those whose own gradients overflowed, as
    ``torch.amp.GradScaler`` does; the scale backs off once either way).

    Running fields: ``scale`` (defaults to ``init``), ``good_steps``
    (consecutive finite steps since the last growth or overflow, always < ``interval``) and
    ``overflows_left`` (overflows it takes to back off; 1 means the next one does; defaults
    to ``hysteresis``).

    Example: a float16 policy whose scale starts lower and never falls under 128::

        import mixprec

        scale = mixprec.DynamicScale(init=2.0**12, min=128.0)
        policy = mixprec.get_policy("O2", loss_scale=scale)
        # the same as a spec string:
        policy == mixprec.get_policy("O2,loss_scale=dynamic(init=4096,min=128)")  # True

    The new scale is used on the very next step. One update, in full::

        if found_inf:                                # the step is skipped: event "skip"
            good_steps = 0
            if overflows_left > 1:                   # tolerated by hysteresis
                overflows_left -= 1
            else:                                    # back off: event "backoff"
                scale = scale * backoff
                if scale < min:                      # clamp: event "floor", then warn/raise
                    scale = min
        else:
            good_steps += 1
            if good_steps == interval:               # the interval-th finite step in a row
                good_steps = 0
                overflows_left = hysteresis          # the tolerance refills here (refill="growth")
                grown = builtins.min(scale * growth, max)
                if grown <= FLOAT32_MAX:             # never past float32, even with max=inf
                    scale = grown                    # event "growth" if it changed
            if refill == "finite":
                overflows_left = hysteresis          # apex: every finite step refills it

    Hysteresis follows Megatron-LM's ``DynamicGradScaler`` and DeepSpeed's
    ``DynamicLossScaler`` with its default ``consecutive_hysteresis=False``: ``hysteresis=h``
    tolerates ``h - 1`` overflows, after which every overflow backs off, until the scale
    grows again (``interval`` finite steps in a row), which refills the tolerance. A lone
    finite step does not refill it. ``refill="finite"`` is apex's ``update_scale_hysteresis``
    instead: every finite step refills the tolerance, so only ``hysteresis`` overflows *in a
    row* back off. With ``hysteresis=1`` and neither ``min`` nor ``max``
    reached, the sequence of scales equals ``torch.amp.GradScaler``'s.

    At the floor the scale is clamped at ``min`` and, with ``on_floor="warn"``, one
    :class:`~mixprec.errors.MixprecWarning` is issued per clamped backoff; with
    ``on_floor="raise"`` :class:`~mixprec.errors.LossScaleError` is raised instead.
    """

    init: float = 2.0**16
    growth: float = 2.0
    backoff: float = 0.5
    interval: int = 2000
    hysteresis: int = 1
    min: float = 1.0
    max: float = 2.0**24
    on_floor: Literal["warn", "raise"] = "warn"
    refill: Literal["growth", "finite"] = "growth"
    skip: Literal["group", "optimizer"] = "group"
    scale: float = None  # type: ignore[assignment]  # None: start at ``init``
    good_steps: int = 0
    overflows_left: int = None  # type: ignore[assignment]  # None: ``hysteresis``
    kind: ClassVar[str] = "dynamic"

    def __post_init__(self) -> None:
        fix = "see help(mixprec.DynamicScale) for the meaning of each argument"
        set_ = object.__setattr__
        init = _positive_finite("DynamicScale init", self.init, fix)
        set_(self, "init", init)
        growth = _positive_finite("DynamicScale growth", self.growth, fix)
        if growth < 1.0:
            raise PolicyError(f"DynamicScale growth must be >= 1, got {self.growth!r}; try 2.0")
        set_(self, "growth", growth)
        backoff = _positive_finite("DynamicScale backoff", self.backoff, fix)
        if backoff >= 1.0:
            raise PolicyError(
                f"DynamicScale backoff must be between 0 and 1, got {self.backoff!r}; try 0.5"
            )
        set_(self, "backoff", backoff)
        set_(self, "interval", _count("DynamicScale interval", self.interval, 1, "try 2000"))
        hysteresis = _count("DynamicScale hysteresis", self.hysteresis, 1, "1 means no tolerance")
        set_(self, "hysteresis", hysteresis)
        low = _positive_finite("DynamicScale min", self.min, fix)
        if self.max == math.inf:  # no ceiling
            high = math.inf
        else:
            high = _positive_finite("DynamicScale max", self.max, "or math.inf for no ceiling")
        if not low <= init <= min(high, FLOAT32_MAX):
            raise PolicyError(
                f"DynamicScale needs 0 < min <= init <= max, got min={self.min!r}, "
                f"init={self.init!r}, max={self.max!r}; move init inside [min, max]"
            )
        set_(self, "min", low)
        set_(self, "max", high)
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                choices = " or ".join(repr(a) for a in allowed)
                raise PolicyError(
                    f"DynamicScale {name} must be {choices}, got {getattr(self, name)!r}"
                )
        # running fields
        if self.scale is None:
            set_(self, "scale", init)
        else:
            scale = _positive_finite("DynamicScale scale", self.scale, fix)
            if not low <= scale <= high:
                raise PolicyError(
                    f"DynamicScale scale={self.scale!r} lies outside [min, max] = "
                    f"[{low!r}, {high!r}]; leave scale unset to start at init"
                )
            set_(self, "scale", scale)
        good = _count("DynamicScale good_steps", self.good_steps, 0, "leave it at 0")
        if good >= self.interval:
            raise PolicyError(
                f"DynamicScale good_steps={good} must be below interval={self.interval}; "
                "leave it at 0"
            )
        set_(self, "good_steps", good)
        if self.overflows_left is None:
            set_(self, "overflows_left", hysteresis)
        else:
            left = _count("DynamicScale overflows_left", self.overflows_left, 1, "leave it unset")
            if left > hysteresis:
                raise PolicyError(
                    f"DynamicScale overflows_left={left} exceeds hysteresis={hysteresis}; "
                    "leave it unset to start at hysteresis"
                )
            set_(self, "overflows_left", left)

    @property
    def enabled(self) -> bool:
        """True: the loss is scaled by ``scale``."""
        return True

    def _moved(self, scale: float, good_steps: int, overflows_left: int) -> DynamicScale:
        # Runs on every step: copy the already-validated fields instead of re-running
        # __post_init__ through the constructor or dataclasses.replace.
        new = object.__new__(DynamicScale)
        new.__dict__.update(self.__dict__)
        new.__dict__["scale"] = scale
        new.__dict__["good_steps"] = good_steps
        new.__dict__["overflows_left"] = overflows_left
        return new

    def update(self, found_inf: bool) -> ScaleUpdate:
        """The state for the next step (see the class docstring for the algorithm)."""
        scale = self.scale
        if not found_inf:
            good = self.good_steps + 1
            if good < self.interval:
                left = self.hysteresis if self.refill == "finite" else self.overflows_left
                return ScaleUpdate(self._moved(scale, good, left), _NO_EVENTS)
            grown = min(scale * self.growth, self.max)
            if grown > FLOAT32_MAX:  # past float32 every scaled loss is inf: stay (exact power)
                grown = scale
            events = (ScaleEvent("growth", scale, grown),) if grown != scale else _NO_EVENTS
            return ScaleUpdate(self._moved(grown, 0, self.hysteresis), events)
        if self.overflows_left > 1:
            skip = ScaleEvent("skip", scale, scale)
            return ScaleUpdate(self._moved(scale, 0, self.overflows_left - 1), (skip,))
        target = scale * self.backoff
        if target >= self.min:
            events = (ScaleEvent("skip", scale, target), ScaleEvent("backoff", scale, target))
            return ScaleUpdate(self._moved(target, 0, 1), events)
        self._hit_floor(scale, target)
        floor = self.min
        events = (ScaleEvent("skip", scale, floor), ScaleEvent("floor", scale, floor))
        return ScaleUpdate(self._moved(floor, 0, 1), events)

    def _hit_floor(self, scale: float, target: float) -> None:
        what = (
            f"the dynamic loss scale hit its floor: backing off from {scale:g} would give "
            f"{target:g}, below min={self.min:g}. Gradients overflow even at the smallest "
            "allowed scale, which almost always means an inf/NaN is produced in the forward "
            "pass or the loss itself, not in the scaled gradients, and no loss scale fixes "
            "that. Fix: find the overflowing op and keep it in float32 (for example "
            "policy.with_ops(fp32=['softmax']) or a module rule), check the inputs and the "
            "learning rate, or train with bfloat16 compute"
        )
        if self.on_floor == "raise":
            raise LossScaleError(
                f"{what}; or set on_floor='warn' to clamp at min and keep skipping."
            )
        warnings.warn(
            f"{what}. The scale stays at min={self.min:g} and overflowing steps are "
            "skipped; set on_floor='raise' to stop instead.",
            MixprecWarning,
            stacklevel=3,
        )

    def state_dict(self) -> dict[str, Any]:
        """Every field, configuration and running, plus ``"kind": "dynamic"``."""
        d: dict[str, Any] = {"kind": self.kind}
        d.update((f.name, getattr(self, f.name)) for f in fields(self))
        return d

    def fresh(self) -> DynamicScale:
        """The same configuration, starting over at ``init``."""
        return self._moved(self.init, 0, self.hysteresis)

    config = fresh


_CHOICES = {
    "on_floor": ("warn", "raise"),
    "refill": ("growth", "finite"),
    "skip": ("group", "optimizer"),
}

LossScaleConfig = NoScale | StaticScale | DynamicScale
"""The loss-scale configuration a :class:`~mixprec.Policy` holds (one of the three classes)."""

#: Each loss-scale class by its ``kind`` (the ``"kind"`` key of its ``state_dict()``).
LOSS_SCALE_KINDS: dict[str, type[NoScale] | type[StaticScale] | type[DynamicScale]] = {
    cls.kind: cls for cls in (NoScale, StaticScale, DynamicScale)
}


def loss_scale_from_state_dict(d: Mapping[str, Any]) -> LossScaleConfig:
    """Rebuild the exact loss-scale state that ``state.state_dict()`` returned."""
    kind = d.get("kind")
    cls = LOSS_SCALE_KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise CheckpointError(
            f"unknown loss-scale kind {kind!r} in a saved state; expected one of "
            f"{sorted(LOSS_SCALE_KINDS)}. Was it saved by mixprec's LossScale.state_dict()?"
        )
    expected = {f.name for f in fields(cls)}
    if cls is DynamicScale:  # saved before these settings existed: their defaults
        d = {"refill": "growth", "skip": "group", **d}
    got = set(d) - {"kind"}
    if got != expected:
        missing, extra = sorted(expected - got), sorted(got - expected)
        raise CheckpointError(
            f"saved {kind!r} loss-scale state does not match this mixprec version: "
            f"missing {missing}, unexpected {extra}; save it again with state_dict()"
        )
    try:
        return cls(**{name: d[name] for name in expected})
    except PolicyError as err:
        raise CheckpointError(f"saved {kind!r} loss-scale state is invalid: {err}") from err
