"""Delayed FP8 scaling as a pure state machine: amax histories, no tensors, no frameworks.

Beside the loss scales of :mod:`mixprec.numerics.loss_scale`: a :class:`DelayedScaling` is a frozen
value holding, for every tensor an FP8 layer quantises (``"<module>:input"``,
``"<module>:weight"``, ``"<module>:grad_output"``), the amax of its last ``history`` steps,
newest first. A backend scales each tensor by :meth:`DelayedScaling.scale` during a step,
records the tensor's amax as it goes, and after the step calls
:meth:`DelayedScaling.update` with those amaxes and whether the step was skipped; the
returned state's scales are used on the very next step. One update, in full::

    if skipped:                                   # the optimizer step did not happen
        return the same state                     # (so a bad batch never enters a history)
    for each tensor with a recorded amax a:
        if a is not finite:                       # refused: listed in the update's result
            keep its history
        else:
            history = (a, *history)[:self.history]

    scale(name, fmt) = None                       # no history yet: scale it "tensorwise"
                     | tensor_scale(max(history), fmt, margin)

where :func:`mixprec.numerics.fp8.recipes.tensor_scale` is ``fmt_max / amax`` in float32, divided by
``2**margin``, and ``1.0`` for an amax of 0. Every field, configuration and running,
round-trips through :meth:`~DelayedScaling.state_dict` and
:meth:`~DelayedScaling.from_state_dict`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from mixprec.errors import CheckpointError, PolicyError
from mixprec.numerics.fp8.recipes import FP8Recipe, tensor_scale

__all__ = ["DelayedScaling", "DelayedUpdate"]


class DelayedUpdate(NamedTuple):
    """What one :meth:`DelayedScaling.update` produced: the next state, and the tensors
    whose amax was refused because it was not finite."""

    state: DelayedScaling
    refused: tuple[str, ...]


@dataclass(frozen=True)
class DelayedScaling:
    """Delayed per-tensor FP8 scaling (Transformer Engine's ``DelayedScaling`` with the
    ``"max"`` amax algorithm): ``history`` steps of amax per tensor, ``margin`` halvings of
    the scale. See the module docstring for the update.

    :param amax_history: tensor name -> its recorded amaxes, newest first (at most
        ``history`` of them).
    """

    history: int = 16
    margin: int = 0
    amax_history: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    kind: ClassVar[str] = "delayed"

    def __post_init__(self) -> None:
        # the recipe's own checks: the same bounds as the policy item
        FP8Recipe("delayed", self.history, self.margin)
        if not isinstance(self.amax_history, Mapping):
            raise PolicyError("amax_history must map tensor names to tuples of amaxes")
        kept = {}
        for name, values in self.amax_history.items():
            seq = tuple(float(v) for v in values)
            if not isinstance(name, str) or len(seq) > self.history:
                raise PolicyError(
                    f"amax history of {name!r} holds {len(seq)} values, more than "
                    f"history={self.history}"
                )
            if not all(math.isfinite(v) and v >= 0.0 for v in seq):
                raise PolicyError(f"amax history of {name!r} holds a negative or non-finite value")
            kept[name] = seq
        object.__setattr__(self, "amax_history", kept)

    @classmethod
    def for_recipe(cls, recipe: FP8Recipe) -> DelayedScaling:
        """A fresh state for the ``delayed`` recipe's settings."""
        return cls(recipe.history, recipe.margin)

    def scale(self, name: str, fmt: str) -> float | None:
        """The float32 scale of tensor ``name`` in format ``fmt`` for the next step, or None
        while it has no history (the backend then scales it by its current amax)."""
        seen = self.amax_history.get(name)
        if not seen:
            return None
        return tensor_scale(max(seen), fmt, self.margin)

    def update(self, amaxes: Mapping[str, float], skipped: bool) -> DelayedUpdate:
        """The state after a step that recorded ``amaxes`` (tensor name -> amax; tensors the
        step did not run are absent). A skipped step changes nothing; a non-finite amax is
        refused (its history is kept) and named in the result."""
        if skipped or not amaxes:
            return DelayedUpdate(self, ())
        histories = dict(self.amax_history)
        refused = []
        for name, amax in amaxes.items():
            value = float(amax)
            if not math.isfinite(value) or value < 0.0:
                refused.append(name)
                continue
            histories[name] = (value, *histories.get(name, ()))[: self.history]
        return DelayedUpdate(DelayedScaling(self.history, self.margin, histories), tuple(refused))

    def fresh(self) -> DelayedScaling:
        """The same configuration with no history."""
        return DelayedScaling(self.history, self.margin)

    def state_dict(self) -> dict[str, Any]:
        """Every field as plain data: ``kind``, ``history``, ``margin``, ``amax_history``."""
        return {
            "kind": self.kind,
            "history": self.history,
            "margin": self.margin,
            "amax_history": {name: list(values) for name, values in self.amax_history.items()},
        }

    @classmethod
    def from_state_dict(cls, d: object) -> DelayedScaling:
        """The exact state :meth:`state_dict` returned.

        :raises CheckpointError: a malformed or foreign state, naming what is wrong.
        """
        keys = {"kind", "history", "margin", "amax_history"}
        if not isinstance(d, Mapping) or set(d) != keys or d.get("kind") != cls.kind:
            shown = sorted(map(str, d)) if isinstance(d, Mapping) else type(d).__name__
            raise CheckpointError(
                f"a saved delayed FP8 scaling state has keys {sorted(keys)} and kind "
                f"'delayed'; got {shown}. Save it with DelayedScaling.state_dict()"
            )
        histories = d["amax_history"]
        if not isinstance(histories, Mapping) or not all(
            isinstance(k, str)
            and isinstance(v, list | tuple)
            and all(isinstance(x, int | float) and not isinstance(x, bool) for x in v)
            for k, v in histories.items()
        ):
            raise CheckpointError(
                "a saved delayed FP8 scaling state's amax_history must map tensor names to "
                "lists of numbers"
            )
        try:
            return cls(d["history"], d["margin"], histories)
        except (PolicyError, TypeError, ValueError) as err:
            raise CheckpointError(f"a saved delayed FP8 scaling state is invalid: {err}") from err
