"""O2/O3: float32 islands around the single ops that have no low-precision kernel here.

Under an O2/O3 policy every op passes its inputs' dtype through, so a bfloat16 net calls
``FullyConnected`` with bfloat16 data and weights. Where this machine has no bfloat16 kernel
for an op (:func:`mixprec_mxnet.ops.unsupported_natives`: ``dot``, ``LayerNorm``... on every
CPU; ``FullyConnected``, ``Convolution``, ``BatchNorm``... on CPUs without AVX512-BF16), the
op runs as a float32 island: its floating inputs are cast to float32, it computes in float32,
and its outputs are cast back to the block's dtype. This is what O1's graph pass does with the
same ops (it puts them in its float32 list); here it happens op by op, in every block whose
activations are low precision, whether or not the net is hybridized.

How: a block's ``hybrid_forward(F, ...)`` reaches every operator through ``F`` (``mx.nd`` or
``mx.sym``), so each such block gets an ``F`` whose island ops are wrapped. The weights stay in
the policy's dtype (their float32 copies are temporaries of the graph), so the gradients, the
masters and the saved values are those of the policy. Ops called through ``mx.nd``/``mx.sym``
directly (not through ``F``) are not seen.

**Chained islands.** On a CPU without AVX512-BF16 whole runs of ops are islands (a CNN's
Conv -> BatchNorm -> ReLU -> MaxPool, all of them). Each island's output is rounded to
bfloat16, as the policy says (the activations between ops are bfloat16: on a CPU with the
kernels the next op reads exactly that), but reading it back through ``amp_cast`` costs
~90 ns per element forward and ~170 ns back on an AVX2 CPU (casts were 85% of an O2-bf16
CNN step there). Inside :func:`chained_islands` (the Trainer's boundary opens it around each
forward call of the net) an island reading the bfloat16 output of the island before it
widens it with ``Cast`` instead (exact), its gradient rounded to bfloat16 on the way back by
float32 ops (:func:`~mixprec_mxnet.bf16_rounding.symbol_from_bf16`,
:func:`~mixprec_mxnet.bf16_rounding.from_bf16_recorded`): ``amp_cast``'s bits, forward and
backward. Layout ops (``Flatten``, ``reshape``, ...) between two islands are applied to that
float32 value and cast after: rounding commutes with them, so their bfloat16 result is bit
for bit the same. (Until 2026-11-29 the next island read the *unrounded* float32 output, so
O2-bf16 on AVX2 kept float32 activations through every run of islands: not the policy's
numerics, tests/mxnet/test_mx_island_numerics.py.)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Collection, Iterator
from contextvars import ContextVar
from typing import Any

import mxnet as mx
from mxnet import gluon
from mxnet.ndarray import NDArray
from mxnet.symbol import Symbol

from mixprec.kit import BFLOAT16, FLOAT32, is_low_precision

from ..bf16_rounding import from_bf16_recorded, symbol_from_bf16, symbol_to_bf16
from ..dtypes import cast, dtype_name, mx_dtype, mx_type_code

__all__ = [
    "DATA_ONLY_OPS",
    "LAYOUT_OPS",
    "IslandOps",
    "block_natives",
    "chained_islands",
    "converting",
    "enter",
    "install_op_islands",
    "island_call",
    "layout_call",
    "leave",
    "unconverted",
]

#: A Gluon parameter's ``__dtype__`` attribute in a traced graph when it is bfloat16
_BF16_CODE = str(mx_type_code(BFLOAT16))

#: Gluon layer class -> the native op its ``hybrid_forward`` calls, for the dtype report.
_LAYER_OPS = {
    "Dense": "FullyConnected",
    "_Conv": "Convolution",
    "_BatchNorm": "BatchNorm",
    "BatchNorm": "BatchNorm",
    "_Pooling": "Pooling",
    "Activation": "Activation",
    "LeakyReLU": "LeakyReLU",
    "PReLU": "LeakyReLU",
    "ELU": "LeakyReLU",
    "SELU": "LeakyReLU",
    "GELU": "LeakyReLU",
}

#: Ops whose other inputs MXNet requires in float32 (BatchNorm's gamma/beta/statistics, the
#: last two updated in place): only their data input is cast, so the statistics stay the
#: parameters' own arrays and not a temporary copy.
DATA_ONLY_OPS = frozenset({"BatchNorm", "_contrib_BatchNormWithReLU", "_contrib_SyncBatchNorm"})

#: Ops that only move elements (no arithmetic): casting commutes with them bit for bit, so
#: between two islands they run on the float32 value and the chain goes on through them.
LAYOUT_OPS = frozenset(
    {"Flatten", "flatten", "Reshape", "reshape", "transpose", "expand_dims", "squeeze"}
    | {"SwapAxis", "swapaxes"}
)

#: False inside :func:`unconverted`: islands and casts pass everything through unchanged.
_CONVERTING: ContextVar[bool] = ContextVar("mixprec_converting", default=True)


@contextlib.contextmanager
def unconverted() -> Iterator[None]:
    """Run the net as it was before the conversion (float32 throughout): the Trainer's
    shape-inference pass over a plain ``Block`` with deferred shapes, whose weights are still
    float32 then."""
    token = _CONVERTING.set(False)
    try:
        yield
    finally:
        _CONVERTING.reset(token)


def converting() -> bool:
    """Whether the policy's casts apply now (False inside :func:`unconverted`)."""
    return _CONVERTING.get()


#: Within :func:`chained_islands`: ``id(cast back) -> (cast back, dtype)`` for each island
#: output cast back in this forward call (holding it keeps the ids unique).
_CHAIN: ContextVar[dict[int, tuple[Any, str]] | None] = ContextVar(
    "mixprec_island_chain", default=None
)


@contextlib.contextmanager
def chained_islands() -> Iterator[None]:
    """Let islands widen the output of the island before them by fast casts in this block."""
    token = _CHAIN.set({})
    try:
        yield
    finally:
        _CHAIN.reset(token)


def _chained(value: Any) -> tuple[Any, str] | None:
    """``value`` widened to float32 (exact, the gradient rounded back to ``value``'s dtype)
    and its dtype, when it is an island's output cast back in this forward call."""
    chain = _CHAIN.get()
    if chain is None or isinstance(value, (list, tuple)):
        return None
    entry = chain.get(id(value))
    if entry is None or entry[0] is not value:
        return None
    dtype = entry[1]
    if dtype == BFLOAT16:
        wide = symbol_from_bf16(value) if isinstance(value, Symbol) else from_bf16_recorded(value)
    elif isinstance(value, Symbol):
        wide = mx.sym.amp_cast(value, dtype=mx_dtype(FLOAT32))
    else:
        wide = cast(value, FLOAT32)
    return wide, dtype


def _remember(back: Any, dtype: str) -> Any:
    chain = _CHAIN.get()
    if chain is not None:
        chain[id(back)] = (back, dtype)
    return back


def enter(value: Any, dtype: str = FLOAT32) -> Any:
    """Floating arrays/Symbols in ``value`` (nested lists/tuples) cast to ``dtype`` for an
    island computing in it; inside :func:`chained_islands`, an island output cast back is
    widened by :func:`_chained`'s fast casts when ``dtype`` is float32."""
    chained = _chained(value) if dtype == FLOAT32 else None
    if chained is not None:
        return chained[0]
    if isinstance(value, NDArray):
        return cast(value, dtype)
    if isinstance(value, Symbol):
        if dtype == FLOAT32 and value.attr("__dtype__") == _BF16_CODE:
            return symbol_from_bf16(value)  # a bfloat16 weight: no amp_cast (see the module)
        return mx.sym.amp_cast(value, dtype=mx_dtype(dtype))
    if isinstance(value, (list, tuple)):
        return type(value)(enter(v, dtype) for v in value)
    return value


def leave(value: Any, dtype: str, inside: str = FLOAT32) -> Any:
    """An island's outputs ``value`` (computed in ``inside``) cast back to ``dtype``;
    inside :func:`chained_islands` the cast of a float32 output is remembered for the next
    island."""
    if isinstance(value, NDArray):
        back = cast(value, dtype)
        wide = inside == FLOAT32 and dtype_name(value.dtype) == FLOAT32
        return _remember(back, dtype) if wide else back
    if isinstance(value, Symbol):
        outputs = len(value.list_outputs())
        target = mx_dtype(dtype)
        if outputs == 1:
            fast = dtype == BFLOAT16 and inside == FLOAT32
            back = symbol_to_bf16(value) if fast else mx.sym.amp_cast(value, dtype=target)
            return _remember(back, dtype) if inside == FLOAT32 else back
        return mx.sym.Group([mx.sym.amp_cast(value[i], dtype=target) for i in range(outputs)])
    if isinstance(value, (list, tuple)):
        return type(value)(leave(v, dtype, inside) for v in value)
    return value


def _low_ndarrays(values: Any) -> bool:
    if isinstance(values, NDArray):
        return is_low_precision(dtype_name(values.dtype))
    if isinstance(values, (list, tuple)):
        return any(_low_ndarrays(v) for v in values)
    return False


def island_call(op: str, fn: Callable[..., Any], dtype: str, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` computed in float32, outputs cast to ``dtype``.

    Imperative calls whose inputs hold no low-precision array run unchanged (nothing to do);
    symbolic calls cannot see dtypes, so they are always wrapped (a cast to an array's own
    dtype is free).
    """
    symbolic = any(isinstance(a, Symbol) for a in (*args, *kwargs.values()))
    if not symbolic and not _low_ndarrays([*args, *kwargs.values()]):
        return fn(*args, **kwargs)
    if op in DATA_ONLY_OPS:
        args = (enter(args[0]), *args[1:]) if args else args
        if "data" in kwargs:
            kwargs["data"] = enter(kwargs["data"])
    else:
        args = enter(args)
        kwargs = {k: enter(v) for k, v in kwargs.items()}
    return leave(fn(*args, **kwargs), dtype)


def layout_call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` for a layout op: on an island's output widened (then cast
    back, and chained on) where there is one, else unchanged."""
    chained = _chained(args[0]) if args else None
    if chained is None:
        return fn(*args, **kwargs)
    fp32, dtype = chained
    return leave(fn(fp32, *args[1:], **kwargs), dtype)


class IslandOps:
    """``F`` (``mx.nd`` or ``mx.sym``) with the ops in ``ops`` run as float32 islands."""

    def __init__(self, F: Any, ops: Collection[str], dtype: str) -> None:
        self._F, self._ops, self._dtype = F, ops, dtype

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._F, name)
        if name in self._ops:
            return functools.partial(island_call, name, attr, self._dtype)
        if name in LAYOUT_OPS:
            return functools.partial(layout_call, attr)
        return attr


def block_natives(classes: Collection[str]) -> frozenset[str]:
    """The native ops a built-in Gluon layer runs itself, from its class names (MRO)."""
    found = {_LAYER_OPS[name] for name in classes if name in _LAYER_OPS}
    if "Convolution" in found and any(name.endswith("Transpose") for name in classes):
        found = (found - {"Convolution"}) | {"Deconvolution"}
    return frozenset(found)


def install_op_islands(block: gluon.Block, ops: Collection[str], dtype: str) -> None:
    """Make ``block``'s own ``F.<op>`` calls for ``ops`` float32 islands inside a ``dtype``
    block (children are separate blocks: the caller installs them one by one)."""
    if not ops or not isinstance(block, gluon.HybridBlock):
        return
    hybrid_forward = block.hybrid_forward

    def with_islands(F: Any, *args: Any, **params: Any) -> Any:
        if not converting():
            return hybrid_forward(F, *args, **params)
        return hybrid_forward(IslandOps(F, ops, dtype), *args, **params)

    block.hybrid_forward = with_islands
