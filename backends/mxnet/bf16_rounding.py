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
:func:`symbol_round_bf16` (:func:`mixprec_mxnet.o1.graph.round_islands`): the same
splitting, forward (``BlockGrad`` keeps its ops out of the gradient) or backward (a branch
whose gradient autograd sums into the splitting of the incoming gradient:
:func:`_rounded_gradient`). Those differ from ``amp_cast`` only outside
ordinary values: a value or gradient that is infinite or above FLT_MAX / 65537 comes out NaN
(non-finite either way: the step's check skips the step as it would), a subnormal gradient
(or value, in :func:`symbol_round_bf16`) keeps up to 8 significant bits where ``amp_cast``
writes 0, a zero may change sign.
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
    "from_bf16_recorded",
    "round_to_bf16",
    "splittable",
    "symbol_from_bf16",
    "symbol_round_bf16",
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


#: A cast built here is the subgraph from a ``_copy`` node named ``<base>`` + IN_SUFFIX
#: (reading the value) to the node named ``<base>`` + OUT_SUFFIX (the result): how a float32
#: export finds and drops them (:mod:`mixprec_mxnet.wrapping.export`) as MXNet's
#: ``remove_amp_cast`` drops ``amp_cast``.
IN_SUFFIX = "_mixprec_in"
OUT_SUFFIX = "_mixprec_cast"
_names = itertools.count()


def cast_source(by_name: dict[str, dict[str, Any]], name: str) -> list[int] | None:
    """In a symbol's JSON nodes (``by_name``: each node by its name), the entry a cast built
    here reads, when ``name`` is such a cast's result node (None otherwise)."""
    if not name.endswith(OUT_SUFFIX):
        return None
    start = by_name.get(name[: -len(OUT_SUFFIX)] + IN_SUFFIX)
    return list(start["inputs"][0]) if start is not None and start["op"] == "_copy" else None


def _rounded_gradient(F: Any, value: Any, split: Any) -> Any:
    """``BlockGrad(z) - z``: +0 forward (a -0 subtracted from stays -0), and a gradient ``g``
    flowing in reaches ``value`` as ``g`` rounded to bfloat16 (``split`` is ``65537 value``).

    ``z = 65537 x + 65537 (-x) + -(-x)``: autograd's backward gives ``-x`` the gradients
    ``65537 g`` and ``-g``, which it sums in float32 (``u = 65537 g - g``), then gives ``x``
    ``65537 g`` and ``-u``, summed again: ``t - (t - g)`` with ``t = 65537 g``, Veltkamp's
    splitting of ``g``. ``value`` must be read by these nodes alone (the callers read it
    through a copy), or other readers' gradients would join those sums. ``F`` is
    ``mx.sym`` in graphs, ``mx.nd`` under ``autograd.record()``."""
    minus = F.negative(value)
    z = split + minus * SPLIT + F.negative(minus)
    return F.BlockGrad(z) - z


def _start(value: Symbol) -> tuple[str, Symbol]:
    base = f"mixprec_bf16_{next(_names)}"
    return base, mx.sym.identity(value, name=base + IN_SUFFIX)


def symbol_round_bf16(value: Symbol) -> Symbol:
    """float32 ``value`` rounded to bfloat16 and back in a graph, forward and backward, as
    two ``amp_cast`` would (O1's float32 islands: :func:`mixprec_mxnet.o1.graph.round_islands`)."""
    base, value = _start(value)
    split = value * SPLIT
    rounded = mx.sym.BlockGrad(split - (split - value))
    return mx.sym.elemwise_sub(
        rounded, _rounded_gradient(mx.sym, value, split), name=base + OUT_SUFFIX
    )


def symbol_to_bf16(value: Symbol) -> Symbol:
    """float32 ``value`` cast to bfloat16 in a graph, as ``amp_cast`` (the gradient widens
    exactly on the way back)."""
    base, value = _start(value)
    split = value * SPLIT
    rounded = (split - (split - value)) * (mx.sym.abs(value) >= _TINY)
    return mx.sym.Cast(
        value + mx.sym.BlockGrad(rounded - value), dtype=BFLOAT16_NP, name=base + OUT_SUFFIX
    )


def symbol_from_bf16(value: Symbol) -> Symbol:
    """bfloat16 ``value`` cast to float32 in a graph, as ``amp_cast``: exact forward, the
    gradient rounded to bfloat16 on the way back (:func:`_rounded_gradient`; ``Cast``'s own
    backward then truncates it exactly, where alone it would truncate an unrounded one)."""
    base, value = _start(value)
    wide = mx.sym.Cast(value, dtype="float32")
    return mx.sym.elemwise_sub(
        mx.sym.BlockGrad(wide),
        _rounded_gradient(mx.sym, wide, wide * SPLIT),
        name=base + OUT_SUFFIX,
    )


def from_bf16_recorded(value: nd.NDArray) -> nd.NDArray:
    """bfloat16 ``value`` widened to float32 under ``autograd.record()``, as ``amp_cast``
    would: exact forward, the gradient rounded to bfloat16 on the way back (the imperative
    twin of :func:`symbol_from_bf16`; the widened array is read by the rounding alone)."""
    wide = nd.Cast(value, dtype="float32")
    return nd.BlockGrad(wide) - _rounded_gradient(nd, wide, wide * SPLIT)
