"""The training-loop functions in the PyTorch backend's shape: they take the trainer.

``mixprec.mxnet.scale_loss(loss, trainer)`` is ``trainer.scale_loss(loss)``, and so on, so
code written against ``mixprec.torch`` reads the same on Gluon.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mxnet import gluon

from mixprec.events import EventLog
from mixprec.policy import Policy
from mixprec_mxnet.trainer import Trainer

__all__ = ["MixprecState", "master_params", "scale_loss", "state", "unscale"]


@contextlib.contextmanager
def scale_loss(loss: Any, trainer: Trainer) -> Iterator[Any]:
    """``trainer.scale_loss(loss)``, in the PyTorch backend's argument order."""
    with trainer.scale_loss(loss) as scaled:
        yield scaled


def unscale(trainer: Trainer) -> None:
    """``trainer.unscale()``: unscale the master gradients before clipping them."""
    trainer.unscale()


def master_params(trainer: Trainer) -> list[gluon.Parameter]:
    """``trainer.master_params()``: the float32 parameters the optimizer updates."""
    return trainer.master_params()


@dataclass(frozen=True)
class MixprecState:
    """A snapshot of a trainer's loss-scaling state (``state(trainer)``); the same fields as
    the PyTorch backend's."""

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
    """The loss-scale event log (skips, backoffs, growths)."""


def state(trainer: Trainer) -> MixprecState:
    """Loss scale, skip counters, resolved policy and events of ``trainer``."""
    scaler = trainer.scaler
    return MixprecState(
        loss_scale=scaler.scale,
        skipped_steps=scaler.skipped_steps,
        last_step_skipped=scaler.last_step_skipped,
        steps=scaler.steps,
        policy=trainer.policy,
        events=scaler.events,
    )
