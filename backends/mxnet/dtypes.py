"""Canonical dtype names <-> MXNet dtypes, and the one cast mixprec uses.

MXNet 1.x spells bfloat16 as a structured numpy dtype (``[('bfloat16', '<u2')]``) that
``numpy`` and :func:`mixprec.dtypes.canonical_dtype` do not know by name, so every dtype
that crosses between mixprec and MXNet goes through :func:`mx_dtype` and :func:`dtype_name`.

:func:`cast` is the only way this backend changes a floating dtype. It uses ``amp_cast``,
which rounds to nearest-even when narrowing float32 to bfloat16; ``NDArray.astype`` (and
so ``Parameter.cast``) truncates, which would make every cast weight slightly smaller in
magnitude and make a resumed run differ from an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from mxnet import nd

from mixprec.kit import BFLOAT16, FLOAT16, FLOAT32, canonical_dtype

from .gluon_private import type_code

__all__ = [
    "BFLOAT16_NP",
    "cast",
    "cast_into",
    "default_layout",
    "dtype_name",
    "dtype_of",
    "is_floating",
    "map_arrays",
    "mx_dtype",
    "mx_type_code",
]

#: MXNet's bfloat16 dtype object.
BFLOAT16_NP = np.dtype([("bfloat16", np.uint16)])

_TO_MX: dict[str, Any] = {
    FLOAT32: np.dtype(np.float32),
    FLOAT16: np.dtype(np.float16),
    BFLOAT16: BFLOAT16_NP,
    "float64": np.dtype(np.float64),
}
_FLOATING = frozenset(_TO_MX.values())


def mx_dtype(dtype: str) -> Any:
    """The MXNet dtype for a canonical name (or any alias): ``"bf16"`` -> MXNet bfloat16."""
    name = canonical_dtype(dtype)
    try:
        return _TO_MX[name]
    except KeyError:
        from mixprec.errors import UnsupportedDtypeError

        raise UnsupportedDtypeError(
            f"MXNet has no {name} dtype; the Gluon backend computes in float32, float16 "
            "(GPU) and bfloat16 (CPU with oneDNN)"
        ) from None


def dtype_name(dtype: Any) -> str:
    """The canonical name of an MXNet/numpy dtype, such as ``"bfloat16"``.

    Non-floating dtypes come back as numpy names (``"int32"``), which mixprec treats as
    "not floating".
    """
    dt = np.dtype(dtype)
    if dt == BFLOAT16_NP:
        return BFLOAT16
    if dt.kind == "f":
        return canonical_dtype(dt.name)
    return dt.name


def mx_type_code(dtype: str) -> int:
    """MXNet's integer type flag for a canonical dtype (what its C API takes)."""
    np_dtype = mx_dtype(dtype)
    return type_code(np_dtype if np_dtype == BFLOAT16_NP else np_dtype.type)


def dtype_of(array: Any) -> str:
    """The canonical dtype of an NDArray (or a Parameter)."""
    return dtype_name(array.dtype)


def is_floating(dtype: Any) -> bool:
    """Whether an MXNet/numpy dtype is a floating format (bfloat16 included)."""
    return np.dtype(dtype) in _FLOATING


def cast(array: nd.NDArray, dtype: str, out: nd.NDArray | None = None) -> nd.NDArray:
    """``array`` in ``dtype``, rounding to nearest-even; ``array`` itself when it already is.

    With ``out``, the result is written into ``out`` (which must have dtype ``dtype``).
    Non-floating arrays are returned unchanged.
    """
    if out is not None:
        return cast_into(array, out)
    target = mx_dtype(dtype)
    if np.dtype(array.dtype) == target or not is_floating(array.dtype):
        return array
    return nd.amp_cast(array, dtype=target)


def cast_into(array: nd.NDArray, out: nd.NDArray) -> nd.NDArray:
    """Write ``array`` into ``out`` in ``out``'s dtype (rounding to nearest-even); ``out``.

    The per-step copies (model gradient -> master gradient, master -> model weight) go
    through here: it reads the target dtype off ``out``, with no name round trip.
    """
    if out is array:
        return out
    if np.dtype(array.dtype) == np.dtype(out.dtype) or not is_floating(array.dtype):
        array.copyto(out)
        return out
    return nd.amp_cast(array, dtype=out.dtype, out=out)


def default_layout(array: nd.NDArray) -> nd.NDArray:
    """A copy of ``array`` in MXNet's default (plain) layout, for a one-time cast of weights.

    An inference-mode forward pass (``net(x)`` outside ``autograd.record()``) makes oneDNN
    reorder a convolution's weight array in place into its blocked layout, and MXNet 1.9's
    ``amp_cast`` fails on the grouped-convolution ones (depthwise, as in mobilenet): "could
    not create a primitive descriptor for a reorder primitive". ``copy`` writes the plain
    layout. Only for casts made once (parameters cast at Trainer construction, masters made),
    not per step.
    """
    return array.copy()


def map_arrays(state: Any, fn: Callable[[int, Any], Any]) -> Any:
    """An MXNet optimizer's per-parameter state (``updater.states[index]``: an array, a tuple
    or list of them, or None) with ``fn(position, array)`` applied to each of its arrays;
    None stays None, a tuple stays a tuple."""
    if isinstance(state, (tuple, list)):
        items = [fn(i, a) for i, a in enumerate(state)]
        return tuple(items) if isinstance(state, tuple) else items
    return state if state is None else fn(0, state)
