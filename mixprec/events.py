"""Loss-scale events: what happened to the scale, and when.

A :class:`ScaleEvent` is what the pure state machines in :mod:`mixprec.numerics.loss_scale` return;
a :class:`StepEvent` is the same event stamped with the step it happened on. An
:class:`EventLog` keeps a bounded in-memory record of them, counts them, prints them as a
table, plots the scale over time, and calls subscribers as each event arrives (loggers,
LR schedulers that must stay in step with skipped updates).
"""

from __future__ import annotations

import os
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mixprec.atomic import atomic_path
from mixprec.errors import MixprecError

__all__ = ["EVENT_KINDS", "EventKind", "EventLog", "ScaleEvent", "StepEvent"]

EventKind = Literal["skip", "backoff", "growth", "floor"]
EVENT_KINDS: tuple[EventKind, ...] = ("skip", "backoff", "growth", "floor")


@dataclass(frozen=True, slots=True)
class ScaleEvent:
    """One thing the loss scale did on one update.

    ``kind`` is ``"skip"`` (gradients were not finite, so the optimizer step is skipped),
    ``"backoff"`` (the scale shrank), ``"growth"`` (the scale grew) or ``"floor"`` (a backoff
    was clamped at the configured minimum). Every event of one update carries the same
    ``scale_before`` (the scale that step ran with) and ``scale_after`` (the scale the next
    step uses), so an overflow that backs off yields ``skip`` and ``backoff`` with equal
    scales.
    """

    kind: EventKind
    scale_before: float
    scale_after: float


@dataclass(frozen=True, slots=True)
class StepEvent:
    """A :class:`ScaleEvent` stamped with the 0-based index of the step it happened on."""

    step: int
    event: ScaleEvent

    @property
    def kind(self) -> EventKind:
        """The event's kind (see :class:`ScaleEvent`)."""
        return self.event.kind

    @property
    def scale_before(self) -> float:
        """The scale the step ran with."""
        return self.event.scale_before

    @property
    def scale_after(self) -> float:
        """The scale the next step uses."""
        return self.event.scale_after


Subscriber = Callable[[StepEvent], object]


class EventLog:
    """A bounded in-memory record of loss-scale events, with subscribers.

    Only the newest ``maxlen`` events are kept (a run that overflows on every step must not
    grow without bound); :meth:`counts` still counts every event ever recorded.

    >>> log = EventLog()
    >>> _ = log.record(7, ScaleEvent("skip", 1024.0, 512.0))
    >>> log.counts()["skip"]
    1
    """

    def __init__(self, maxlen: int | None = 10_000) -> None:
        self._events: deque[StepEvent] = deque(maxlen=maxlen)
        self._counts: Counter[str] = Counter()
        self._subscribers: list[Subscriber] = []

    # -- recording ------------------------------------------------------------------------

    def record(self, step: int, event: ScaleEvent) -> StepEvent:
        """Store ``event`` as happening on ``step`` and hand it to every subscriber."""
        stamped = StepEvent(step, event)
        self._events.append(stamped)
        self._counts[event.kind] += 1
        for callback in tuple(self._subscribers):
            callback(stamped)
        return stamped

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call ``callback(step_event)`` for every event recorded from now on.

        Returns a function that unsubscribes it again. Exceptions raised by the callback
        propagate to the code that recorded the event (a broken logger should be noticed).
        """
        self._subscribers.append(callback)
        return lambda: self.unsubscribe(callback)

    def unsubscribe(self, callback: Subscriber) -> None:
        """Stop calling ``callback``; unknown callbacks are ignored."""
        if callback in self._subscribers:
            self._subscribers.remove(callback)

    def clear(self) -> None:
        """Forget every recorded event and count (subscribers stay)."""
        self._events.clear()
        self._counts.clear()

    # -- reading --------------------------------------------------------------------------

    @property
    def maxlen(self) -> int | None:
        """How many events are kept (``None``: unbounded)."""
        return self._events.maxlen

    @property
    def events(self) -> list[StepEvent]:
        """The kept events, oldest first."""
        return list(self._events)

    def __len__(self) -> int:
        return len(self._events)

    def __iter__(self) -> Iterator[StepEvent]:
        return iter(tuple(self._events))

    def counts(self) -> dict[str, int]:
        """How many events of each kind were recorded, including ones no longer kept."""
        return {kind: self._counts[kind] for kind in EVENT_KINDS}

    def scales(self) -> list[tuple[int, float]]:
        """``(step, scale)`` points where the scale in use changed, for a step plot.

        The first point is the scale the first kept event's step ran with; each later point
        is the step from which a new scale is in use (the step after the event). Draw them
        with ``drawstyle="steps-post"``.
        """
        points: list[tuple[int, float]] = []
        for rec in self._events:
            if not points:
                points.append((rec.step, rec.scale_before))
            if rec.scale_after != points[-1][1]:
                points.append((rec.step + 1, rec.scale_after))
        return points

    def format(self, last: int | None = None) -> str:
        """A printable table of the kept events (only the newest ``last`` if given)."""
        records = list(self._events)
        if last is not None:
            records = records[-last:] if last > 0 else []
        counts = ", ".join(f"{kind}={n}" for kind, n in self.counts().items())
        if not records:
            return f"no loss-scale events recorded ({counts})"
        rows = [("step", "event", "scale before", "scale after")]
        rows += [
            (str(r.step), r.kind, f"{r.scale_before:g}", f"{r.scale_after:g}") for r in records
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [
            "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append(f"totals: {counts}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()

    def __repr__(self) -> str:
        return f"EventLog({len(self)} events, maxlen={self.maxlen})"

    def plot(self, path: str | os.PathLike[str]) -> str:
        """Save a plot of the loss scale over steps (skips marked) to ``path``; return it.

        Needs matplotlib, which the ``docs`` extra installs.
        """
        try:
            from matplotlib.figure import Figure
        except ImportError as err:
            raise MixprecError(
                "EventLog.plot() needs matplotlib, which is not installed; "
                "install it with: pip install 'mixprec[docs]'"
            ) from err
        fig = Figure(figsize=(7, 3.5))
        ax = fig.add_subplot()
        points = self.scales()
        if points:
            steps, scales = zip(*points, strict=True)
            ax.plot(steps, scales, drawstyle="steps-post", label="loss scale")
        skips = [(r.step, r.scale_before) for r in self._events if r.kind == "skip"]
        if skips:
            ax.scatter(*zip(*skips, strict=True), marker="x", color="tab:red", label="skipped step")
        ax.set_yscale("log", base=2)
        ax.set_xlabel("step")
        ax.set_ylabel("loss scale")
        if points or skips:
            ax.legend()
        fig.tight_layout()
        with atomic_path(path, suffix=Path(os.fspath(path)).suffix) as tmp:
            fig.savefig(tmp)
        return os.fspath(path)
