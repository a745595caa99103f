"""The training-loop functions in the built-in backends' shape: they take the trainer.

``mixprec_numpy.unscale_(trainer)`` is ``trainer.unscale_()``, and so on, so code written
against ``mixprec.torch`` or ``mixprec.mxnet`` reads the same here.
"""

from __future__ import annotations

from mixprec.kit import MixprecState
from mixprec_numpy.layers import Parameter
from mixprec_numpy.trainer import Trainer

__all__ = ["master_params", "state", "unscale_"]


def unscale_(trainer: Trainer) -> None:
    """``trainer.unscale_()``: unscale the gradients into the masters before clipping."""
    trainer.unscale_()


def master_params(trainer: Trainer) -> list[Parameter]:
    """The parameters the optimizer updates: float32 masters where the model's are low
    precision, else the model's own."""
    return trainer.masters.masters()


def state(trainer: Trainer) -> MixprecState:
    """Loss scale, skip counters, resolved policy and events of ``trainer``."""
    return trainer.scaler.snapshot(trainer.policy)
