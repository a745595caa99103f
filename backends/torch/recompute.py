"""Activation checkpointing: a recomputation casts exactly as the forward did.

``torch.utils.checkpoint`` recomputes a checkpointed function during backward, outside the
wrapped model's forward. It restores the autocast state of the forward itself, but not the
op-casting mode (:class:`~mixprec_torch.autocast.PolicyMode`) nor the module decision
context, so under O1 a recomputed ``softmax`` would run in bfloat16 where the forward ran it
in float32: ``CheckpointError`` (non-reentrant) or silently different gradients (reentrant).

Two pieces put them back:

- a checkpointed *module* of a wrapped model (``checkpoint(self.block, x)``, Hugging Face
  ``gradient_checkpointing_enable()``, ``checkpoint_sequential``) is recomputed through its
  entry hooks (:mod:`mixprec_torch.casting`), which see that they run during backward and
  re-open the region and context without the boundary casts the forward did not have;
- a checkpointed plain *function* cannot be seen by any hook: pass
  :func:`checkpoint_context` as ``context_fn`` (non-reentrant checkpointing only, PyTorch's
  own restriction), or checkpoint a module that calls it. Under reentrant checkpointing
  :mod:`mixprec_torch.reentrant` repairs a plain function's recomputation through its graph
  node, or warns (``ReentrantCheckpointWarning``) where its decision context is unknown.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from .autocast import active_casting, context_stack, recomputation

__all__ = ["checkpoint_context"]


def checkpoint_context() -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``
    that makes the recomputation of a plain function cast as its forward did::

        h = torch.utils.checkpoint.checkpoint(
            attention, q, k, v, use_reentrant=False, context_fn=mixprec.torch.checkpoint_context
        )

    Called by ``checkpoint`` inside the wrapped model's forward, it notes the op casting and
    the module decision context in force there; the second context manager puts them back
    around the recomputation in backward. Outside an O1 region (O0, O2, a policy that runs
    autocast alone) both are no-ops. Checkpointed modules of a wrapped model need no
    ``context_fn``: their hooks restore the same state.
    """
    casting = active_casting()
    if casting is None:
        return nullcontext(), nullcontext()
    contexts = context_stack()
    return nullcontext(), recomputation(casting, contexts[-1] if contexts else None)
