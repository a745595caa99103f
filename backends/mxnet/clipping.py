"""Gradient clipping by global norm over every context: ``clip_global_norm(trainer, max_norm)``.

Gluon's ``gluon.utils.clip_global_norm(arrays, max_norm)`` clips the arrays it is given, so
the usual recipe (clip ``p.grad(ctx)`` of the first context) leaves the other contexts'
gradients unclipped and the contexts' weights drift apart; under O2 the model gradients are
also the scaled low-precision ones, not what the optimizer reads. This function clips what
the update reads: the float32 master gradients, reduced over contexts (and workers), unscaled,
with one norm and one factor for every context. Use it between the backward and the update::

    norm = mixprec.mxnet.clip_global_norm(trainer, max_norm=1.0)
    trainer.update(batch_size)        # or trainer.step(batch_size): the reduce is done once
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from mxnet import nd

from mixprec.kit import Stage

from .dtypes import cast
from .step.protocol import trainable_grads

if TYPE_CHECKING:
    from .trainer import Trainer

__all__ = ["clip_global_norm"]


def clip_global_norm(trainer: Trainer, max_norm: float) -> float:
    """Reduce and unscale ``trainer``'s gradients, clip them to a global L2 norm of
    ``max_norm`` on every context, and return the norm they had (inf or NaN when a gradient
    overflowed: nothing is clipped then, and the next ``update`` skips the step)."""
    st = trainer._mixprec
    tracker = st.tracker
    if tracker.stage is not Stage.UNSCALED:
        if not st.scaler.enabled and tracker.stage is Stage.READY and not tracker.backwards:
            tracker.on_backward()  # no scaling: a plain loss.backward() is as good
        trainer.unscale()
    per_context = [list(grads) for grads in zip(*trainable_grads(st), strict=True)]
    if not per_context:
        return 0.0
    # after the reduce every context holds the same sums: the first one's norm is global
    squares = [nd.sum(nd.square(cast(g, "float32"))) for g in per_context[0]]
    norm = math.sqrt(float(nd.add_n(*squares).asscalar()))
    if math.isfinite(norm) and norm > max_norm:
        factor = max_norm / (norm + 1e-8)
        for grads in per_context:
            for grad in grads:
                grad *= factor
    return norm
