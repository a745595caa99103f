"""The NumPy Trainer's step: backward, unscale, overflow check, then update or skip.

:class:`Stepping` is the part of :class:`~mixprec_numpy.trainer.Trainer` that runs every
iteration, in the order of the Gluon backend's ``mixprec_mxnet.step.protocol``: scale the
loss in backward, unscale into float32 master gradients while checking for inf/NaN and a
squared gradient norm beyond float32 (:mod:`mixprec.guard`; after ``unscale_`` the check
waits for the step, so a clip or an edit in between is checked too), record
which parameters overflowed (:func:`record_overflows`, only on a skipped step), let the
scaler decide, step the masters or skip, copy the masters back into the model. Under a
compensated strategy (``master=kahan|stochastic``) the step goes through
:class:`~mixprec_numpy.compensation.Compensation` instead; under a low-bit ``state`` the
optimizer's update goes through :class:`~mixprec_numpy.lowbit.LowBitState`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from mixprec.kit import LossScaler, MasterWeights, OverflowRecord, StepTracker
from mixprec_numpy.casting import cast, float32
from mixprec_numpy.compensation import Compensation
from mixprec_numpy.layers import MLP, Parameter
from mixprec_numpy.lowbit import LowBitState
from mixprec_numpy.optimizer import SGD

__all__ = ["KEPT_OVERFLOWS", "Stepping", "record_overflows"]

#: How many skipped steps' overflow records a trainer keeps.
KEPT_OVERFLOWS = 100


class Stepping:
    """Mixin of :class:`~mixprec_numpy.trainer.Trainer`: the per-iteration step."""

    model: MLP
    optimizer: SGD
    masters: MasterWeights[Parameter]
    scaler: LossScaler
    tracker: StepTracker
    overflows: deque[OverflowRecord]
    """The :class:`mixprec.OverflowRecord` of each of the last 100 skipped steps."""
    _found_inf: bool
    _unchecked: bool
    compensation: Compensation | None
    """The compensated strategy's state under ``master=kahan|stochastic``, else None."""
    lowbit: LowBitState | None
    """The optimizer's moments as codes under ``state=int8|int4|fp8``, else None."""

    def backward(self) -> None:
        """Backpropagate ``loss * loss_scale`` from the model's last :meth:`MLP.loss`."""
        self.tracker.on_backward()
        self.model.backward(self.scaler.scale)

    def unscale_(self) -> None:
        """Divide the gradients by the loss scale now (before clipping); optional. The
        overflow check waits for :meth:`step`, so it sees the gradients after a clip or an
        edit made in between."""
        self.tracker.on_unscale()
        self._unscale(check=False)

    def _unscale(self, check: bool = True) -> None:
        # Unscaled float32 gradients go to the masters, which are what the optimizer steps.
        inverse = np.float32(1.0 / self.scaler.scale)
        squared = np.float32(0.0)
        with np.errstate(over="ignore", invalid="ignore"):
            for param, master in self.masters.pairs:
                if param.grad is None:
                    continue
                master.grad = grad = float32(param.grad) * inverse
                if check:  # the same pass: the check costs no second read of the gradients
                    squared = squared + np.square(grad, dtype=np.float32).sum(dtype=np.float32)
        self._found_inf = not bool(np.isfinite(squared))
        self._unchecked = not check

    def _check(self) -> None:
        # inf or NaN when a gradient is, or when the squared norm leaves float32
        squared = np.float32(0.0)
        with np.errstate(over="ignore", invalid="ignore"):
            for _, master in self.masters.pairs:
                if master.grad is not None:
                    grad = float32(master.grad)
                    squared = squared + np.square(grad, dtype=np.float32).sum(dtype=np.float32)
        self._found_inf = not bool(np.isfinite(squared))
        self._unchecked = False

    def step(self) -> bool:
        """Unscale (unless :meth:`unscale_` ran), then step, or skip when a gradient is
        inf/NaN or the squared gradient norm overflows float32 (checked here, after whatever
        happened since :meth:`unscale_`); update the loss scale and copy the masters into
        the model. Returns whether the step was skipped."""
        if self.tracker.needs_unscale:
            self._unscale()
        elif self._unchecked:
            self._check()
        self.tracker.on_step()
        fp8 = self.model.fp8
        if fp8 is not None and not fp8.finite():  # a bad batch: never into a scale
            self._found_inf = True
        overflowing: tuple[str, ...] = ()
        if self._found_inf:  # before the update, so skip hooks can ask what overflowed
            overflowing = record_overflows(self.scaler.steps, [self])
        skipped = self.scaler.update(self._found_inf, overflowing)
        if fp8 is not None:  # the step's amaxes enter the delayed history, unless skipped
            fp8.settle(skipped)
        # under a low-bit state the moments are decoded around the optimizer's own update
        updater = self.optimizer if self.lowbit is None else self.lowbit
        if not skipped and self.compensation is not None:
            self.compensation.update(updater, self.masters.masters())
        elif not skipped:
            updater.update(self.masters.masters())
            for param, master in self.masters.copied_pairs():
                param.data = cast(master.data, param.dtype)
        for param, master in self.masters.pairs:
            param.grad = master.grad = None
        self.tracker.on_update()
        return skipped


def record_overflows(step: int, members: Sequence[Stepping]) -> tuple[str, ...]:
    """Record, for each trainer of a skipped step, which parameters' unscaled gradients
    overflowed (an inf or NaN, or a squared norm beyond float32; the largest one when only
    the sum did). The same argument order as every backend's ``record_overflows``; returns
    every name found."""
    every: dict[str, None] = {}
    for trainer in members:
        squares = {
            param.name: float(np.square(master.grad, dtype=np.float64).sum())
            for param, master in trainer.masters.pairs
            if master.grad is not None
        }
        limit = float(np.finfo(np.float32).max)
        found = tuple(name for name, sq in squares.items() if not sq <= limit)
        if not found and squares:  # only the sum overflowed
            found = (max(squares, key=squares.__getitem__),)
        every.update(dict.fromkeys(found))
        trainer.overflows.append(OverflowRecord(step, found))
    return tuple(every)
