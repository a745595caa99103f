"""Autocast switched two ways: as flags eagerly, as ``with`` blocks while compiling.

Eagerly, an island of a wrapped model (a float32 BatchNorm under O1) turns autocast off in
its pre-hook by flipping the enabled flag (:func:`disable_autocast`: the nesting level and the
weight-cast cache stay) and back on in its post-hook. Dynamo cannot follow a flag flipped in
one inlined hook and restored in another, so each such module gets a :class:`TracedForward`
as its ``forward`` attribute, which while ``torch.compile`` traces runs the forward inside a
``with torch.autocast(..., enabled=False)`` block (:func:`autocast_each`). The root's
boundary (:mod:`mixprec_torch.wrapping.boundaries`) opens its autocast the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ..copies import CopyOnly

__all__ = ["TracedForward", "autocast_each", "autocast_off", "disable_autocast"]


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


# ------------------------------------------------------------------------------------------


def disable_autocast(device_types: Sequence[str]) -> Callable[[], None]:
    """Turn autocast off for ``device_types``; return the call that turns it back on.

    Only the enabled flag changes (the nesting level and the weight-cast cache stay), so
    an island inside an autocast region costs two flag flips per device type.
    """
    was_on = [dt for dt in device_types if torch.is_autocast_enabled(dt)]
    for dt in was_on:
        torch.set_autocast_enabled(dt, False)

    def restore() -> None:
        for dt in was_on:
            torch.set_autocast_enabled(dt, True)

    return restore


@contextmanager
def autocast_off(device_types: Sequence[str]) -> Iterator[None]:
    """Autocast disabled for ``device_types`` (restored afterwards, nesting level untouched)."""
    restore = disable_autocast(device_types)
    try:
        yield
    finally:
        restore()


class TracedForward(CopyOnly):
    """A pinned module's ``forward`` as an instance attribute: eager calls go straight
    through (its hooks turn autocast off); while ``torch.compile`` traces, it runs the
    forward inside ``with torch.autocast(..., enabled=False)`` blocks.

    :param device_types: the device types whose autocast is turned off.
    :param forward: the module's own ``forward`` (bound).
    """

    def __init__(self, device_types: Sequence[str], forward: Callable[..., Any]) -> None:
        self.device_types = tuple(device_types)
        self.forward = forward
        self.__wrapped__ = forward  # inspect.signature(module.forward) sees the real one

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            return self.forward(*args, **kwargs)
        return autocast_each(self.device_types, None, self.forward, *args, **kwargs)
