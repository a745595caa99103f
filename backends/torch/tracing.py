"""What ``torch.compile`` traces where a wrapped model's hooks would open a region eagerly.

Eagerly, a wrapped model's forward pre-hook enters autocast and the op-casting mode and its
post-hook leaves them (:mod:`mixprec_torch.autocast`, :mod:`mixprec_torch.casting`). Dynamo
cannot follow that: it traces a user-defined model's hooks as frames apart from its forward
(an autocast entered there never reaches the compiled forward), and an autocast flag
flipped in one inlined hook and restored in another breaks its bookkeeping. So ``wrap``
gives the root of an op-casting model, and each module pinned to a dtype under autocast, a
:class:`TracedForward` as its ``forward`` attribute: eager calls go straight through, and
while compiling it runs the forward inside ``with`` blocks, which dynamo traces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from .copies import CopyOnly

__all__ = ["Region", "TracedForward", "autocast_each"]


class Region(Protocol):
    """What :class:`TracedForward` reads of an op-casting plan
    (:class:`~mixprec_torch.autocast.OpCasting` is one)."""

    @property
    def device_types(self) -> tuple[str, ...]: ...
    @property
    def autocast(self) -> torch.dtype | None: ...
    @property
    def table(self) -> dict[Callable[..., Any], Any]: ...
    def mode(self) -> Any:
        """A fresh op-casting ``TorchFunctionMode``."""
        ...


def autocast_each(
    device_types: Sequence[str],
    dtype: torch.dtype | None,
    fn: Callable[..., Any],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """``fn(*args, **kwargs)`` inside ``with torch.autocast(d, dtype=dtype)`` for each device
    type ``d`` (``dtype`` None: autocast off), the form dynamo traces."""
    if not device_types:
        return fn(*args, **kwargs)
    with torch.autocast(device_types[0], dtype=dtype, enabled=dtype is not None):
        return autocast_each(device_types[1:], dtype, fn, *args, **kwargs)


class TracedForward(CopyOnly):
    """A module's ``forward`` as an instance attribute: eager calls go straight through;
    while ``torch.compile`` traces, it runs the forward inside ``with`` blocks (the hooks
    then leave the region to it).

    :param casting: the model's op casting.
    :param forward: the module's own ``forward`` (bound).
    :param region: open the op-casting region (the root of the wrapped model).
    :param island: turn autocast off inside (a module pinned to a dtype).
    """

    def __init__(
        self, casting: Region, forward: Callable[..., Any], *, region: bool, island: bool
    ) -> None:
        self.casting = casting
        self.forward = forward
        self.region = region
        self.island = island
        self.__wrapped__ = forward  # inspect.signature(model.forward) sees the real one

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            return self.forward(*args, **kwargs)
        casting = self.casting
        if not self.region:
            return self._inner(*args, **kwargs)
        if not casting.table:
            return autocast_each(
                casting.device_types, casting.autocast, self._inner, *args, **kwargs
            )
        with casting.mode():
            if casting.autocast is None:
                return self._inner(*args, **kwargs)
            return autocast_each(
                casting.device_types, casting.autocast, self._inner, *args, **kwargs
            )

    def _inner(self, *args: Any, **kwargs: Any) -> Any:
        if self.island:
            return autocast_each(self.casting.device_types, None, self.forward, *args, **kwargs)
        return self.forward(*args, **kwargs)
