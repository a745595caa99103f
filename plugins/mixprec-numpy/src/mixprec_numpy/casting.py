"""Casting NumPy arrays to mixprec's dtypes, including bfloat16, which NumPy lacks.

A float32 or float16 value is stored in an array of that NumPy dtype. A bfloat16 value is
stored in a float32 array whose values are all bfloat16-representable: casting rounds the
float32 bits to the nearest bfloat16, ties to even, exactly as hardware does. A
:class:`Tensor` pairs an array with the mixprec dtype its values are in.
"""

from __future__ import annotations

from typing import Any, NamedTuple, TypeAlias

import numpy as np
import numpy.typing as npt

from mixprec.errors import UnsupportedDtypeError

__all__ = ["Array", "Tensor", "cast", "float32", "round_to_bfloat16", "to"]

Array: TypeAlias = npt.NDArray[Any]
"""A NumPy array of any dtype and shape."""

_STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.float32}


class Tensor(NamedTuple):
    """An array and the dtype of its values (a bfloat16 tensor stores float32)."""

    data: Array
    dtype: str


def round_to_bfloat16(x: Array) -> Array:
    """``x`` rounded to the nearest bfloat16 value (ties to even), as a float32 array."""
    x = np.asarray(x, dtype=np.float32)
    bits = np.atleast_1d(x).view(np.uint32)
    # Add just under half of the 16 dropped bits, plus the kept lowest bit (ties to even),
    # then drop them. NaNs are kept as they are: rounding could turn them into infinities.
    odd = (bits >> np.uint32(16)) & np.uint32(1)
    rounded = ((bits + np.uint32(0x7FFF) + odd) & np.uint32(0xFFFF0000)).view(np.float32)
    return np.where(np.isnan(x), x, rounded.reshape(x.shape))


def cast(x: Array, dtype: str) -> Array:
    """A copy of ``x`` holding its values rounded to ``dtype``."""
    if dtype not in _STORAGE:
        raise UnsupportedDtypeError(
            f"the NumPy backend cannot cast to {dtype}; it knows {', '.join(_STORAGE)}"
        )
    # Beyond float16's range a cast gives inf, as in every framework: that is the overflow
    # loss scaling detects, not an error.
    with np.errstate(over="ignore"):
        stored = np.asarray(x).astype(_STORAGE[dtype])
    return round_to_bfloat16(stored) if dtype == "bfloat16" else stored


def to(t: Tensor, dtype: str) -> Tensor:
    """``t`` in ``dtype`` (itself when it already is)."""
    return t if t.dtype == dtype else Tensor(cast(t.data, dtype), dtype)


def float32(x: Array) -> Array:
    """``x`` as float32 for the arithmetic (exact: every value of our dtypes is a float32)."""
    return x.astype(np.float32, copy=False)
