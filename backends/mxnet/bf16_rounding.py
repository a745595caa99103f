"""float32 <-> bfloat16 on the CPU with MXNet's fast float32 ops, bit for bit ``amp_cast``.

MXNet 1.9's ``amp_cast`` between float32 and bfloat16 has no vectorised CPU kernel: ~170 ns
per element to bfloat16 and ~90 ns back on an AVX2 CPU, against ~1.5 ns for a float32
multiply. On such a CPU, where every bfloat16 op is a float32 island, those casts were most of
an O2-bf16 step (the masters written into the weights, the gradients read into the masters,
the weights read by each island). ``Cast`` is fast but truncates. So:

- **to bfloat16** (:func:`to_bf16_into`): Veltkamp's splitting rounds in float32 (``t - (t -
  x)`` with ``t = 65537 x`` is ``x`` rounded to 8 significant bits, to nearest-even, for every
  normal float32 below FLT_MAX / 65537, ~5.19e33, just under 2^112: checked over all of
  them), then ``Cast`` truncates what is already on the bfloat16 grid. ``amp_cast`` writes a
  value below 2^-126 (float32's subnormals) as a zero of its sign, and so does this
  (``amp_cast`` writes -0 as +0, this keeps -0: the one difference). Arrays with a value of
  2^63 or more, an infinity or a NaN (one ``multi_sum_sq`` over them says) go to
  ``amp_multicast``, as the splitting could overflow;
- **to float32** (:func:`from_bf16_into`): ``Cast``, which is exact (where ``amp_cast``
  would write a bfloat16 subnormal as 0, it keeps it: none comes from ``amp_cast``).

These are for values autograd does not record (the step's copies): the backward of these
ops is not ``amp_cast``'s. In hybridized graphs, where the backward must round too,
:func:`symbol_to_bf16` and :func:`symbol_from_bf16` cast an island's output and a bfloat16
weight into an island (:mod:`mixprec_mxnet.wrapping.islands`), and O1's islands round with
:func:`mixprec_mxnet.o1.graph.bf16_rounding_nodes`: the same splitting, forward (``BlockGrad``
keeps its ops out of the gradient) or backward (a branch whose gradient autograd sums into
the splitting of the incoming gradient). Those differ from ``amp_cast`` only outside
ordinary values: a value or gradient that is infinite or above FLT_MAX / 65537 comes out NaN
(non-finite either way: the step's check skips the step as it would), a subnormal gradient
keeps up to 8 significant bits where ``amp_cast`` writes 0, a zero may change sign.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import mxnet as mx
from mxnet import nd
from mxnet.symbol import Symbol

from .dtypes import BFLOAT16_NP

__all__ = [
    "IN_SUFFIX",
    "OUT_SUFFIX",
    "SPLIT",
    "cast_source",
    "from_bf16_into",
    "round_to_bf16",
    "splittable",
    "symbol_from_bf16",
    "symbol_to_bf16",
    "to_bf16_into",
]

#: Veltkamp's splitting constant for float32 -> bfloat16: 2^(24 - 8) + 1
SPLIT = 65537.0
_TINY = 2.0**-126  # below: float32's subnormals, which amp_cast writes as zeros
#: a sum of squares below this means every |x| < 2^63: the splitting cannot overflow
_SQUARES_BOUND = 2.0**126


def splittable(arrays: Sequence[nd.NDArray]) -> bool:
    """Whether every value of the float32 ``arrays`` is finite and below 2^63 in magnitude
    (their sum of squares is): :func:`to_bf16_into` is exact for them. One op and one read."""
    if not arrays:
        return True
    sums = nd.multi_sum_sq(*arrays, num_arrays=len(arrays))
    total = float(nd.sum(sums).asscalar())
    return total < _SQUARES_BOUND  # False for inf and NaN


def round_to_bf16(x: nd.NDArray) -> nd.NDArray:
    """float32 ``x`` rounded to bfloat16 (nearest-even), as float32, with ``amp_cast``'s
    bits for every |x| < FLT_MAX / 65537 but -0 (so: check :func:`splittable` first)."""
    split = x * SPLIT
    rounded = split - (split - x)
    # below 2^-126 -> a zero of x's sign, as amp_cast writes them (amp_cast writes -0 as +0)
    return rounded * (x.abs() >= _TINY)


def to_bf16_into(src: nd.NDArray, dst: nd.NDArray) -> nd.NDArray:
    """Write float32 ``src`` into bfloat16 ``dst`` as ``amp_cast`` would, for a ``src``
    :func:`splittable` passed; ``dst``."""
    return nd.Cast(round_to_bf16(src), dtype=dst.dtype, out=dst)


def from_bf16_into(src: nd.NDArray, dst: nd.NDArray) -> nd.NDArray:
    """Write bfloat16 ``src`` into float32 ``dst`` (exact); ``dst``."""
    return nd.Cast(src, dtype=dst.dtype, out=dst)


#: A cast built here (or by :func:`mixprec_mxnet.o1.graph.bf16_rounding_nodes`) is the
#: subgraph from a ``_copy`` node named ``<base>`` + IN_SUFFIX (reading the value) to the node
#: named ``<base>`` + OUT_SUFFIX (the result): how a float32 export finds and drops them
#: (:mod:`mixprec_mxnet.wrapping.export`) as MXNet's ``remove_amp_cast`` drops ``amp_cast``.
IN_SUFFIX = "_mixprec_in"
OUT_SUFFIX = "_mixprec_cast"
_names = itertools.count()


def cast_source(nodes: list[dict[str, Any]], entry: list[int]) -> list[int] | None:
    """In a symbol's JSON ``nodes``, the value a cast built here reads, when ``entry`` is
    such a cast's result (None otherwise)."""
    name = nodes[entry[0]]["name"]
    if not name.endswith(OUT_SUFFIX):
        return None
    start = name[: -len(OUT_SUFFIX)] + IN_SUFFIX
    for node in nodes:
        if node["name"] == start and node["op"] == "_copy":
            return list(node["inputs"][0])
    return None


def symbol_to_bf16(value: Symbol) -> Symbol:
    """float32 ``value`` cast to bfloat16 in a graph, as ``amp_cast`` (the gradient widens
    exactly on the way back)."""
    base = f"mixprec_bf16_{next(_names)}"
    value = mx.sym.identity(value, name=base + IN_SUFFIX)
    split = value * SPLIT
    rounded = (split - (split - value)) * (mx.sym.abs(value) >= _TINY)
    return mx.sym.Cast(
        value + mx.sym.BlockGrad(rounded - value), dtype=BFLOAT16_NP, name=base + OUT_SUFFIX
    )


def symbol_from_bf16(value: Symbol) -> Symbol:
    """bfloat16 ``value`` cast to float32 in a graph, as ``amp_cast``: exact forward, the
    gradient rounded to bfloat16 on the way back (``Cast``'s own backward would truncate it).

    The gradient ``g`` of the result reaches ``wide`` through ``z = 65537 w + 65537 (-w) +
    -(-w)`` alone (``w`` is ``wide``; the value is ``BlockGrad(wide) - (BlockGrad(z) - z)``),
    whose backward sums ``65537 g`` and ``-(65537 g - g)`` in float32: ``g`` rounded by
    Veltkamp's splitting, which ``Cast``'s backward then truncates exactly."""
    base = f"mixprec_bf16_{next(_names)}"
    wide = mx.sym.Cast(mx.sym.identity(value, name=base + IN_SUFFIX), dtype="float32")
    minus = mx.sym.negative(wide)
    z = wide * SPLIT + minus * SPLIT + mx.sym.negative(minus)
    return mx.sym.elemwise_sub(
        mx.sym.BlockGrad(wide), mx.sym.BlockGrad(z) - z, name=base + OUT_SUFFIX
    )
