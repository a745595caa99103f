"""The step guard: what makes a step unsafe to apply, and the warning for repeated skips.

Every backend skips a step whose gradients are unsafe to apply, under every policy, with or
without loss scaling:

- a gradient holds an inf or a NaN, or
- the squared global gradient norm (the sum of every gradient element squared, accumulated
  in float32) overflows float32: the global norm exceeds about ``1.8e19``
  (:data:`NORM_LIMIT`). A finite but huge loss (``1e30``) gives such gradients; applied, they
  turn Adam's second moment (``grad**2``) into inf and throw SGD-momentum weights to ``1e27``.

The backends compute the check in the same fused pass as the inf/NaN check (a squared norm
is NaN or inf when any element is), keep the flag on the device and read it with the step's
one host sync. This module holds what is framework-free: :class:`StepGuard`, the user's
configuration, and :class:`SkipWatch`, which counts skips in a row and warns
(:class:`RepeatedSkipWarning`) with the step numbers and the parameters that overflowed.

The warning points at the user's line, not mixprec's: :func:`user_stacklevel` walks the
frames out of mixprec's packages (:data:`MIXPREC_PACKAGES`) and the framework code a call
passes through on its way in (a with-statement's exit, torch's optimizer-step wrapper).
Python 3.12's ``warnings.warn(skip_file_prefixes=...)`` would do it by file name; mixprec
supports 3.10, so it walks the frames itself.
"""

from __future__ import annotations

import math
import operator
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mixprec.errors import MixprecWarning, PolicyError

__all__ = [
    "MIXPREC_PACKAGES",
    "NORM_LIMIT",
    "RepeatedSkipWarning",
    "SkipWatch",
    "StepGuard",
    "user_stacklevel",
]

#: The largest global gradient norm a step may have: its square is float32's largest value.
NORM_LIMIT = math.sqrt(3.4028234663852886e38)


#: mixprec's packages: the core, the backends and the plugins. A warning raised inside them
#: points at the first line outside.
MIXPREC_PACKAGES = ("mixprec", "mixprec_torch", "mixprec_mxnet", "mixprec_numpy", "mixprec_jax")

#: Code a call from the user's line into mixprec passes through: a with-statement's exit
#: (``contextlib``), the frameworks' own wrappers (torch's optimizer-step hook wrapper),
#: the trainers that drive a loop (Lightning, Accelerate).
_PASSED_THROUGH = frozenset(
    {
        "contextlib",
        "torch",
        "mxnet",
        "numpy",
        "jax",
        "jaxlib",
        "lightning",
        "lightning_fabric",
        "pytorch_lightning",
        "accelerate",
    }
)


def _inside(frame: Any) -> bool:
    root = str(frame.f_globals.get("__name__", "")).partition(".")[0]
    return root in MIXPREC_PACKAGES or root in _PASSED_THROUGH


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the calling function that makes the
    warning point at the user's line: the first frame, walking out from the caller, that is
    neither in mixprec's packages (:data:`MIXPREC_PACKAGES`) nor in the framework code the
    call came through. Where every frame is (a script run by ``python -m mixprec``), the
    outermost."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and _inside(frame):
        frame = frame.f_back
        level += 1
    return level


class RepeatedSkipWarning(MixprecWarning):
    """Several steps in a row were skipped: training is not progressing (the message names
    the steps and the parameters whose gradients overflowed)."""


@dataclass(frozen=True)
class StepGuard:
    """How a backend reports skipped steps.

    ``warn_after``: warn (:class:`RepeatedSkipWarning`) when this many steps in a row were
    skipped, and again after each further ``warn_after``; ``0`` never warns. Pass it as
    ``mixprec.torch.wrap(..., guard=StepGuard(warn_after=20))`` or
    ``mixprec.mxnet.Trainer(..., guard={"warn_after": 20})``.

    The guard itself (skip a step whose gradients are non-finite or whose squared norm
    overflows float32) cannot be switched off: applying such a step would put a non-finite
    value into the weights or the optimizer state.
    """

    warn_after: int = 10

    def __post_init__(self) -> None:
        value = self.warn_after
        try:
            if isinstance(value, bool):
                raise TypeError
            number = operator.index(value)
        except TypeError:
            raise PolicyError(
                f"StepGuard warn_after must be an integer, got {value!r}; pass the number of "
                "skipped steps in a row that should warn (default 10, 0 never warns)"
            ) from None
        if number < 0:
            raise PolicyError(
                f"StepGuard warn_after must be >= 0, got {number}; 0 never warns, 10 is the default"
            )
        object.__setattr__(self, "warn_after", number)

    @classmethod
    def coerce(cls, value: StepGuard | Mapping[str, Any] | None) -> StepGuard:
        """``value`` as a :class:`StepGuard`: None gives the default, a dict its fields.

        :raises PolicyError: an unknown field or a bad value, naming the fix.
        """
        if value is None:
            return cls()
        if isinstance(value, StepGuard):
            return value
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - {"warn_after"})
            if unknown:
                raise PolicyError(
                    f"unknown StepGuard option(s) {unknown}; the option is 'warn_after'"
                )
            return cls(**value)
        raise PolicyError(
            f"guard must be a mixprec.StepGuard, a dict of its options or None, got "
            f"{type(value).__name__}; for example guard=mixprec.StepGuard(warn_after=20)"
        )


def _spans(steps: Sequence[int]) -> str:
    """``"3-7, 9"`` for steps 3, 4, 5, 6, 7, 9."""
    parts: list[str] = []
    start = prev = steps[0]
    for step in steps[1:]:
        if step != prev + 1:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = step
        prev = step
    parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ", ".join(parts)


class SkipWatch:
    """Counts skipped steps in a row and warns every ``guard.warn_after`` of them.

    A backend calls :meth:`observe` once per step, after the loss scaler's update, with the
    parameters that overflowed on a skipped step.
    """

    def __init__(self, guard: StepGuard | None = None) -> None:
        self.guard = guard if guard is not None else StepGuard()
        self.run: list[tuple[int, tuple[str, ...]]] = []
        """(step, overflowing parameter names) of each skipped step of the current run."""

    @property
    def in_a_row(self) -> int:
        """How many of the latest steps were skipped, in a row."""
        return len(self.run)

    def observe(
        self,
        step: int,
        skipped: bool,
        params: Sequence[str] = (),
        what: str = "",
        rank: int | None = None,
    ) -> None:
        """Note one step; warn when the run of skips reaches a multiple of ``warn_after``.

        The warning points at the user's line (:func:`user_stacklevel`).

        :param step: the step's 0-based index (the scaler's ``steps`` before its update).
        :param skipped: whether it was skipped.
        :param params: on a skip, the names of the parameters whose gradients overflowed.
        :param what: the policy and loss scale, for the message.
        :param rank: this process's rank in a run of several ranks, None in a run of one;
            the message names it (and another rank's overflow as a cause) only when given.
        """
        if not skipped:
            self.run.clear()
            return
        self.run.append((step, tuple(params)))
        every = self.guard.warn_after
        if every and len(self.run) % every == 0:
            text = self.message(what, rank)
            warnings.warn(text, RepeatedSkipWarning, stacklevel=user_stacklevel())

    def message(self, what: str = "", rank: int | None = None) -> str:
        """The warning text for the current run of skips (``rank``: see :meth:`observe`)."""
        recent = self.run[-self.guard.warn_after :] if self.guard.warn_after else self.run
        steps = [step for step, _ in recent]
        by_param: dict[str, list[int]] = {}
        for step, names in recent:
            for name in names:
                by_param.setdefault(name, []).append(step)
        if by_param:
            shown = sorted(by_param.items(), key=lambda kv: (-len(kv[1]), kv[0]))[:8]
            params = "; ".join(f"{name} (steps {_spans(s)})" for name, s in shown)
            if len(by_param) > len(shown):
                params += f"; and {len(by_param) - len(shown)} more"
        elif rank is not None:
            params = f"none in rank {rank}'s gradients (another rank overflowed, or a "
            params += "BatchNorm running statistic became inf or NaN)"
        else:
            params = "none named (a BatchNorm running statistic or an FP8 amax became inf or "
            params += "NaN, or the overflow was found before the gradients were checked one by one)"
        under = f" under {what}" if what else ""
        where = f" on rank {rank}" if rank is not None else ""
        return (
            f"mixprec skipped {len(self.run)} steps in a row{under}{where} (the latest: steps "
            f"{_spans(steps)}): their gradients held an inf or NaN, or their squared norm "
            f"overflowed float32 (norm > {NORM_LIMIT:.3g}). Overflowing parameters: {params}. "
            "The weights, masters and optimizer state are unchanged, but training is not "
            "progressing. Look for a NaN/inf or huge value in the inputs or the loss, lower "
            "the learning rate, keep the overflowing op in float32 (policy.with_ops(fp32=[...])) "
            "or clip the loss; StepGuard(warn_after=...) sets how often this warns"
        )
