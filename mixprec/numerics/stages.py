"""StepTracker: the READY → UNSCALED → STEPPED stage machine of one optimizer.

Modelled on ``torch.amp.GradScaler``'s per-optimizer ``OptState``. The backend reports each
call of the training loop; a call in an order that cannot be right raises
:class:`~mixprec.errors.StepOrderError` naming what was missing and the fix. A backend's
``step()`` uses it like this::

    if tracker.needs_unscale:      # the user did not call unscale_() before clipping
        unscale_gradients()
    tracker.on_step()
    ...                            # found_inf, skip or step, scaler.update(found_inf)
    tracker.on_update()            # once the group's loss scale has been updated
"""

from __future__ import annotations

import enum

from mixprec.errors import StepOrderError

__all__ = ["Stage", "StepTracker"]


class Stage(enum.Enum):
    """Where one optimizer is within the current iteration."""

    READY = "ready"
    """Gradients (if any) are still scaled; backward passes may accumulate."""
    UNSCALED = "unscaled"
    """``unscale_()`` ran: gradients are true values, ready for clipping and ``step()``."""
    STEPPED = "stepped"
    """``step()`` ran; waiting for the loss-scale update that ends the iteration."""


_SCALE_LOSS = "wrap the loss in scale_loss(loss, optimizer) and call backward on the result"


class StepTracker:
    """The stage of one optimizer, checked on every call of the training loop.

    Several scaled backward passes before one step (gradient accumulation) are fine.
    """

    __slots__ = ("backwards", "stage", "steps")

    def __init__(self) -> None:
        self.stage = Stage.READY
        self.backwards = 0
        """Scaled backward passes since the last step (more than one: accumulation)."""
        self.steps = 0
        """Completed steps (skipped ones included) of this optimizer."""

    @property
    def needs_unscale(self) -> bool:
        """True when ``step()`` must unscale the gradients itself (no ``unscale_()`` call)."""
        return self.stage is Stage.READY and self.backwards > 0

    def on_backward(self) -> None:
        """A scaled backward pass ran for this optimizer."""
        stage = self.stage
        if stage is Stage.READY:
            self.backwards += 1
        elif stage is Stage.UNSCALED:
            raise StepOrderError(
                "a backward pass ran after unscale_(): gradients would mix scaled and "
                "unscaled values; unscale only after the last micro-batch's backward, "
                "right before clipping and step()"
            )
        else:
            raise StepOrderError(
                "a backward pass ran after step() but before the loss scale was updated: "
                "its gradients would be scaled with a stale scale; step every optimizer that "
                "shares the loss scale once per iteration before the next backward pass"
            )

    def cancel_backward(self) -> None:
        """Take back the latest :meth:`on_backward`: the backward pass it announced never ran
        (the user's code raised inside ``scale_loss``)."""
        if self.backwards > 0:
            self.backwards -= 1

    def on_unscale(self) -> None:
        """``unscale_()`` was called: gradients become true values."""
        stage = self.stage
        if stage is Stage.READY:
            if self.backwards == 0:
                raise StepOrderError(
                    "unscale_() was called but no scaled backward pass ran since the last "
                    f"step(): {_SCALE_LOSS}, then call unscale_() before clipping"
                )
            self.stage = Stage.UNSCALED
        elif stage is Stage.UNSCALED:
            raise StepOrderError(
                "unscale_() has already been called on this optimizer since the last step(); "
                "call it once per step, after the last backward and before clipping"
            )
        else:
            raise StepOrderError(
                "unscale_() was called after step(); call it before optimizer.step() "
                "(or not at all: step() unscales by itself)"
            )

    def on_step(self) -> None:
        """``step()`` was called (the backend unscales first when :attr:`needs_unscale`)."""
        stage = self.stage
        if stage is Stage.UNSCALED or (stage is Stage.READY and self.backwards > 0):
            self.stage = Stage.STEPPED
            return
        if stage is Stage.STEPPED:
            raise StepOrderError(
                "step() has already been called on this optimizer in this iteration; "
                "call it once per iteration, after the backward pass"
            )
        if self.steps == 0:
            raise StepOrderError(
                f"step() was called before any scaled backward pass: {_SCALE_LOSS}"
            )
        raise StepOrderError(
            "step() was called twice without a scaled backward pass in between, which would "
            f"apply the previous gradients again: {_SCALE_LOSS} before each step()"
        )

    def on_update(self) -> None:
        """The loss scale was updated: a stepped optimizer starts the next iteration.

        An optimizer of the group that did not step this iteration keeps its stage, so its
        accumulated gradients stay accounted for.
        """
        if self.stage is Stage.STEPPED:
            self.stage = Stage.READY
            self.backwards = 0
            self.steps += 1

    def reset(self) -> None:
        """Back to READY with no pending backward (after an error or a checkpoint load)."""
        self.stage = Stage.READY
        self.backwards = 0

    def __repr__(self) -> str:
        return (
            f"StepTracker(stage={self.stage.name}, backwards={self.backwards}, steps={self.steps})"
        )
