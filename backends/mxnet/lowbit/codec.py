"""The block-wise low-bit codec in NumPy, on the host: the Gluon twin of the torch backend's
``mixprec_torch.lowbit.codec``, code for code.

The scheme and the maps are :mod:`mixprec.numerics.lowbit`'s (through the kit). Per block of
``fmt.block`` elements of a flat float32 array: ``a = max |x|``; ``n = x / a`` (a true float32
division; 0 where ``a == 0``); ``code = #{mids < n}``; decoding is ``values[code] * a``.
4-bit codes are packed two per byte, the even element in the low nibble. Every operation is
exactly rounded float32 arithmetic, so the codes and the decoded values are the torch twin's
and the NumPy reference's, bit for bit.

Why NumPy on the host: MXNet 1.9 has no ``searchsorted`` and no bit casts, and its
elementwise division is not promised to be the correctly rounded one on every device, while
the codes must match the other backends exactly. On CPU contexts the host *is* the device
(the cost is a copy out and a copy back); on a GPU it is a transfer each way per state array
and step.

``#{mids < n}`` without a binary search: ``n`` lies in ``[-1, 1]``, and the top 17 bits of
its float32 pattern (sign, exponent and 8 mantissa bits) name a *bucket* of values whose
relative width is at most ``2**-8``, narrower than the gap between any two mids of every map
(the finest, int8's top decade, spaces its values 1.4 % apart). So a bucket holds at most one
mid, and ``code = below[bucket] + (mid_in[bucket] < n)``, with ``below`` the number of mids
under the bucket's smallest value and ``mid_in`` the one mid inside it (``+inf`` if none):
two table reads and a comparison per element, about ten times faster than ``searchsorted``.
The tables are built from the map's own midpoints and checked to hold one mid per bucket at
most; a map that did not fit would fall back to ``np.searchsorted`` (the same count).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import numpy.typing as npt

from mixprec.kit import StateFormat, state_map

__all__ = ["Tables", "absmax", "block_count", "code_count", "dequantize", "quantize", "tables"]

Float32Array = npt.NDArray[np.float32]
Uint8Array = npt.NDArray[np.uint8]

#: float32 bits dropped to name a bucket: 32 - 15 = 17 bits (sign, exponent, 8 mantissa bits).
_SHIFT = 15


class Tables:
    """One map as float32 arrays, with the bucket tables that count the mids under a value."""

    def __init__(self, fmt_name: str, signed: bool) -> None:
        smap = state_map(fmt_name, signed)
        self.values = np.asarray(smap.values, dtype=np.float32)
        self.mids = np.asarray(smap.mids, dtype=np.float32)
        patterns = np.arange(1 << (32 - _SHIFT), dtype=np.uint32) << np.uint32(_SHIFT)
        first = patterns.view(np.float32)
        last = (patterns | np.uint32((1 << _SHIFT) - 1)).view(np.float32)
        negative = (patterns >> np.uint32(31)).astype(bool)
        low = np.where(negative, last, first)  # the bucket's smallest value
        high = np.where(negative, first, last)
        with np.errstate(invalid="ignore"):  # NaN buckets: never a normalised value
            below = np.searchsorted(self.mids, low, side="left")
            inside = np.searchsorted(self.mids, high, side="right") - below
            finite = np.isfinite(low) & np.isfinite(high)
        self.exact = bool(np.all(inside[finite] <= 1))
        """Whether every bucket holds at most one mid (else :func:`quantize` searches)."""
        self.below = below.astype(np.uint8)
        mid_in = np.full(below.shape, np.inf, dtype=np.float32)
        one = finite & (inside == 1)
        mid_in[one] = self.mids[below[one]]
        self.mid_in = mid_in

    def codes(self, normal: Float32Array) -> npt.NDArray[Any]:
        """``#{mids < n}`` for every element of ``normal`` (float32), as integers."""
        if not self.exact:
            return np.searchsorted(self.mids, normal, side="left")
        bucket = normal.view(np.uint32) >> np.uint32(_SHIFT)
        found: npt.NDArray[Any] = self.below[bucket] + (self.mid_in[bucket] < normal)
        return found


@functools.cache
def tables(fmt_name: str, signed: bool) -> Tables:
    """The cached :class:`Tables` of a format's signed or unsigned map."""
    return Tables(fmt_name, signed)


def code_count(fmt: StateFormat, numel: int) -> int:
    """How many bytes of codes an array of ``numel`` elements takes."""
    return (numel + 1) // 2 if fmt.bits == 4 else numel


def block_count(fmt: StateFormat, numel: int) -> int:
    """How many blocks (absmax values) an array of ``numel`` elements takes."""
    return math.ceil(numel / fmt.block)


def _blocks(flat: Float32Array, block: int) -> Float32Array:
    """``flat`` zero-padded to whole blocks, as (blocks, block)."""
    pad = (-flat.size) % block
    if pad:
        flat = np.concatenate([flat, np.zeros(pad, dtype=np.float32)])
    return flat.reshape(-1, block)


def absmax(x: Float32Array, fmt: StateFormat) -> Float32Array:
    """Each block's largest magnitude (float32; NaN where the block holds one)."""
    scale: Float32Array = np.abs(_blocks(np.ravel(x), fmt.block)).max(axis=1)
    return scale


def quantize(x: npt.ArrayLike, fmt: StateFormat, signed: bool) -> tuple[Uint8Array, Float32Array]:
    """The codes (uint8, flat, packed for 4 bits) and per-block absmax of float32 ``x``."""
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    numel = flat.size
    blocks = _blocks(flat, fmt.block)
    a = np.abs(blocks).max(axis=1) if blocks.size else np.zeros(0, dtype=np.float32)
    divisor = np.where(a > 0, a, np.float32(1.0))  # a == 0: the block is all zeros
    with np.errstate(invalid="ignore"):  # inf / inf: the caller refuses a non-finite absmax
        normal = np.ascontiguousarray(blocks / divisor[:, None], dtype=np.float32)
        found = tables(fmt.name, signed).codes(normal.reshape(-1))
    codes = found[:numel].astype(np.uint8)
    if fmt.bits == 4:
        if numel % 2:
            codes = np.concatenate([codes, np.zeros(1, dtype=np.uint8)])
        codes = codes[0::2] | (codes[1::2] << np.uint8(4))
    return codes, a.astype(np.float32, copy=False)


def dequantize(
    codes: npt.ArrayLike, a: npt.ArrayLike, fmt: StateFormat, signed: bool, numel: int
) -> Float32Array:
    """The float32 values (flat, ``numel`` elements) that ``codes`` and ``a`` stand for."""
    packed = np.asarray(codes, dtype=np.uint8).reshape(-1)
    if fmt.bits == 4:
        index = np.stack([packed & np.uint8(15), packed >> np.uint8(4)], axis=1).reshape(-1)
        index = index[:numel]
    else:
        index = packed
    values = tables(fmt.name, signed).values[index]
    scale = np.asarray(a, dtype=np.float32).reshape(-1)
    decoded = _blocks(values, fmt.block) * scale[:, None]
    return np.ascontiguousarray(decoded.reshape(-1)[:numel], dtype=np.float32)
