"""Activation checkpointing: a recomputation casts exactly as the forward did, with no change
to the user's code.

``torch.utils.checkpoint`` recomputes a checkpointed callable during backward, after the
wrapped model's forward returned. It restores the forward's autocast state itself; O1's
decisions come back through torch's own dispatch: the kernels at the Autocast key find the
region the forward ran in from the autograd node being run (:mod:`mixprec_torch.o1.regions`),
for every kind of checkpointed callable (a module, a bound method, a ``functools.partial``,
a lambda, ``checkpoint_sequential``) and both ``use_reentrant`` modes.

:func:`checkpoint_context` is kept for code written against earlier versions (and for a
checkpoint nested inside a recomputed plain function, which no forward recorded): as a
``context_fn`` it reopens the region in force where ``checkpoint`` was called.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from .regions import Region, current, pop, push

__all__ = ["checkpoint_context"]


@contextmanager
def _reopened(region: Region) -> Iterator[None]:
    push(region)
    try:
        yield
    finally:
        pop()


def checkpoint_context() -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``
    that reopens the region of the forward around the recomputation::

        h = torch.utils.checkpoint.checkpoint(
            attention, q, k, v, use_reentrant=False, context_fn=mixprec.torch.checkpoint_context
        )

    Not needed any more: a recomputation finds its forward's region by itself. Outside a
    region (O0, O2, a policy that runs autocast alone) both context managers do nothing.
    """
    region = current()
    if region is None:
        return nullcontext(), nullcontext()
    return nullcontext(), _reopened(region)
