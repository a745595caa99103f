"""Rounding Python floats to low-precision formats, bit-exactly, without any framework.

The suite receives parameters as plain floats and checks that each model parameter equals
its float32 master rounded to the parameter's dtype. Both roundings are IEEE
round-to-nearest-even, as every framework's cast does.
"""

from __future__ import annotations

import math
import struct

__all__ = ["round_to"]


def _to_float32(x: float) -> float:
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]  # type: ignore[no-any-return]
    except OverflowError:
        return math.copysign(math.inf, x)


def _to_float16(x: float) -> float:
    try:
        return struct.unpack("<e", struct.pack("<e", x))[0]  # type: ignore[no-any-return]
    except OverflowError:  # beyond float16's range: the cast gives inf
        return math.copysign(math.inf, x)


def _to_bfloat16(x: float) -> float:
    if math.isnan(x):
        return x
    (bits,) = struct.unpack("<I", struct.pack("<f", _to_float32(x)))
    bits += 0x7FFF + ((bits >> 16) & 1)  # round to nearest, ties to even, on the dropped half
    (value,) = struct.unpack("<f", struct.pack("<I", (bits >> 16 << 16) & 0xFFFFFFFF))
    return value  # type: ignore[no-any-return]


_ROUND = {"float32": _to_float32, "float16": _to_float16, "bfloat16": _to_bfloat16}


def round_to(dtype: str, x: float) -> float:
    """``x`` rounded to the nearest value of ``dtype`` (float32, float16 or bfloat16)."""
    try:
        return _ROUND[dtype](x)
    except KeyError:
        raise ValueError(f"round_to() knows {sorted(_ROUND)}, not {dtype!r}") from None
