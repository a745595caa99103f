"""The training-loop functions in the PyTorch backend's shape: they take the trainer.

``mixprec.mxnet.scale_loss(loss, trainer)`` is ``trainer.scale_loss(loss)``, and so on, so
code written against ``mixprec.torch`` reads the same on Gluon.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from mxnet import gluon

from mixprec.kit import MixprecState

from .trainer import Trainer

__all__ = ["MixprecState", "master_params", "scale_loss", "state", "unscale", "unscale_"]


@contextlib.contextmanager
def scale_loss(loss: Any, trainer: Trainer) -> Iterator[Any]:
    """``trainer.scale_loss(loss)``, in the PyTorch backend's argument order."""
    with trainer.scale_loss(loss) as scaled:
        yield scaled


def unscale_(trainer: Trainer) -> None:
    """``trainer.unscale()``: unscale the master gradients in place before clipping them
    (``mixprec.torch.unscale_(optimizer)`` in the PyTorch backend)."""
    trainer.unscale()


#: The name this function had before it took the PyTorch backend's (in-place ``_``) name.
unscale = unscale_


def master_params(trainer: Trainer) -> list[gluon.Parameter]:
    """``trainer.master_params()``: the float32 parameters the optimizer updates."""
    return trainer.master_params()


def state(trainer: Trainer) -> MixprecState:
    """Loss scale, skip counters, resolved policy and events of ``trainer``."""
    return trainer.scaler.snapshot(trainer.policy)
