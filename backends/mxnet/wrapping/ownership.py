"""One Trainer per net, and a failed Trainer construction that leaves the net untouched.

A mixprec Trainer converts its net in place (parameters cast, forwards wrapped, masters made
from the weights it finds). A second Trainer on the same parameters would build its masters
from the first one's rounded low-precision copies and wrap the forwards twice, so
:func:`check_unclaimed` refuses it; :func:`claim` marks the parameters once a Trainer is
built. :class:`Snapshot` records every block's and parameter's attributes before the
conversion and puts them back when the construction fails (an unreachable ``dist_sync``
kvstore, a refused policy...), so the user's net is exactly as it was.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from mxnet import gluon

from mixprec.errors import WrapError

__all__ = ["Snapshot", "check_unclaimed", "claim"]

_CLAIMED: weakref.WeakKeyDictionary[gluon.Parameter, str] = weakref.WeakKeyDictionary()


def check_unclaimed(params: Sequence[gluon.Parameter]) -> None:
    """Refuse parameters a mixprec Trainer already converted."""
    taken = [p for p in params if p in _CLAIMED]
    if taken:
        raise WrapError(
            f"parameter {taken[0].name!r} already belongs to a mixprec Trainer (policy "
            f"{_CLAIMED[taken[0]]}), which converted it in place; a second Trainer would "
            "build its float32 masters from rounded copies. Keep one Trainer per net (change "
            "the learning rate with trainer.set_learning_rate), or build the net anew"
        )


def claim(params: Sequence[gluon.Parameter], label: str) -> None:
    """Mark ``params`` as converted by a Trainer running policy ``label``."""
    for param in params:
        _CLAIMED[param] = label


class Snapshot:
    """The attributes of a net's blocks and of some parameters, to put back on failure."""

    def __init__(self, blocks: Sequence[gluon.Block], params: Sequence[gluon.Parameter]) -> None:
        self._saved: list[tuple[Any, dict[str, Any]]] = [
            (obj, dict(vars(obj))) for obj in [*blocks, *params]
        ]

    def restore(self) -> None:
        """Put every recorded attribute back; remove the ones added since."""
        for obj, attrs in self._saved:
            state = vars(obj)
            state.clear()
            state.update(attrs)
