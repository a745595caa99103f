"""Optimizer state in 8 and 4 bits for optax: the codec in ``jax.numpy`` and a state transform.

:mod:`mixprec.numerics.lowbit` defines the formats (``int8``, ``int4``, ``fp8``), their maps
and the block-wise scheme; ``mixprec_numpy.lowbit`` is its readable reference, and
:func:`quantize` / :func:`dequantize` here are the same lines in ``jax.numpy``: per block of
``fmt.block`` elements ``a = max |x|``, ``n = x / a`` (0 where ``a == 0``),
``code = jnp.searchsorted(mids, n, side="left")`` on the float32 midpoints, decoded as
``values[code] * a``; 4-bit codes two per byte, the even element in the low nibble. Each
operation is exactly rounded (the division kept one: XLA would otherwise multiply by the
reciprocal of ``a``), so the codes and decoded values are the reference's bit for bit, with
one difference written down: XLA on the CPU flushes subnormal floats to zero in
every operation, so the codec flushes them explicitly on every device (inputs before
encoding, values after decoding): its result is the reference's on the input with
subnormals set to zero, with subnormal decoded values set to zero.

:func:`quantized_state` wraps an optax ``GradientTransformation`` so that its per-parameter
moments live between steps as :class:`QuantizedArray` (codes and block absmax): Adam's and
AdamW's ``mu`` (signed map) and ``nu`` (the unsigned map of the second moment) in
``ScaleByAdamState``, AMSGrad's ``mu``, ``nu``, ``nu_max`` and SGD's momentum ``trace`` in
``TraceState``, wherever they sit in a chain. ``update`` decodes them into float32, runs the
optimizer's own update, and encodes them again. Which leaves are quantized is decided once,
in ``init``, from the format's ``min_size`` and ``keep`` (fnmatch patterns over the leaf
names, ``params.Dense_0.kernel``), and is part of the state's tree structure, so everything
stays traceable. :class:`mixprec_jax.Optimizer` applies it for a policy's ``state=int8``
etc.; there a skipped step keeps the codes bit for bit (``jnp.where`` on ``uint8``), and an
update that would make a moment inf or NaN is skipped too (an encoded non-finite block
cannot be decoded again).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mixprec.errors import CheckpointError, WrapError
from mixprec.kit import StateFormat, parse_state_format, state_map
from mixprec_jax.casting import PyTree
from mixprec_jax.trees import leaf_names

__all__ = [
    "SUPPORTED",
    "QuantizedArray",
    "all_finite",
    "check_codes",
    "dequantize",
    "quantize",
    "quantized_state",
]

_TINY = np.float32(np.finfo(np.float32).tiny)  # the smallest normal float32

#: The optax states whose moments are quantized: field -> signed map (False: the second
#: moment's unsigned map).
_MOMENTS: dict[type, dict[str, bool]] = {
    optax.ScaleByAdamState: {"mu": True, "nu": False},
    optax.ScaleByAmsgradState: {"mu": True, "nu": False, "nu_max": False},
    optax.TraceState: {"trace": True},
}
#: What a refusal names.
SUPPORTED = (
    "optax.adam, optax.adamw, optax.nadam, optax.nadamw, optax.amsgrad and optax.sgd "
    "(momentum): any chain whose per-parameter state is scale_by_adam's or "
    "scale_by_amsgrad's moments or trace's momentum"
)


class QuantizedArray(NamedTuple):
    """One state array between steps (a pytree node, so it jits, saves and selects).

    Example::

        import jax.numpy as jnp

        import mixprec.jax as mpj
        from mixprec.kit import parse_state_format
        from mixprec_jax.lowbit import dequantize, quantize

        fmt = parse_state_format("int4(block=32)")
        q = quantize(jnp.linspace(-1.0, 1.0, 40), fmt, signed=True)
        assert isinstance(q, mpj.QuantizedArray)
        assert q.codes.shape == (20,) and q.absmax.shape == (2,)  # 2 codes a byte, 2 blocks
        assert float(dequantize(q, fmt, True, (40,))[0]) == -1.0  # the absmax is exact
    """

    codes: jax.Array
    """uint8, flat: one code a byte, or two (``int4``: the even element in the low nibble)."""
    absmax: jax.Array
    """float32, one per block: the block's largest magnitude."""


@functools.cache
def _table(name: str, signed: bool) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The map's values and midpoints (NumPy float32 constants, traced as literals)."""
    smap = state_map(name, signed)
    return np.array(smap.values, np.float32), np.array(smap.mids, np.float32)


def _flush(x: jax.Array) -> jax.Array:
    return jnp.where(jnp.abs(x) >= _TINY, x, jnp.float32(0.0))


def _blocks(flat: jax.Array, block: int) -> jax.Array:
    pad = -flat.size % block
    return jnp.pad(flat, (0, pad)).reshape(-1, block)


def quantize(x: jax.Array, fmt: StateFormat, signed: bool) -> QuantizedArray:
    """The codes and block absmax of ``x`` (read as float32 in row-major order)."""
    flat = _flush(jnp.asarray(x, jnp.float32).reshape(-1))
    blocks = _blocks(flat, fmt.block)
    absmax = jnp.max(jnp.abs(blocks), axis=1, initial=jnp.float32(0.0))
    divisor = jnp.broadcast_to(
        jnp.where(absmax > 0, absmax, jnp.float32(1.0))[:, None], blocks.shape
    )
    # XLA rewrites x / broadcast(a) as x * (1 / a), which is not the rounded quotient (it
    # moved a quarter of the codes of ties by one, and 1 / a underflows for a > 2**126):
    # the barrier keeps a true division
    normal = blocks / jax.lax.optimization_barrier(divisor)
    _, mids = _table(fmt.name, signed)
    codes = jnp.searchsorted(mids, normal.reshape(-1)[: flat.size], side="left")
    codes = codes.astype(jnp.uint8)
    if fmt.bits == 4:
        codes = jnp.pad(codes, (0, codes.size % 2))
        codes = codes[0::2] | (codes[1::2] << 4)
    return QuantizedArray(codes, absmax)


def dequantize(
    q: QuantizedArray, fmt: StateFormat, signed: bool, shape: tuple[int, ...]
) -> jax.Array:
    """The float32 array of ``shape`` that ``q`` stands for: ``values[code] * a``."""
    numel = int(np.prod(shape))
    index = q.codes
    if fmt.bits == 4:
        index = jnp.stack([index & 15, index >> 4], axis=1).reshape(-1)[:numel]
    values, _ = _table(fmt.name, signed)
    decoded = _blocks(jnp.asarray(values)[index], fmt.block) * q.absmax[:, None]
    return _flush(decoded.reshape(-1)[:numel]).reshape(shape)


# ---------------------------------------------------------------------- walking optax states


def _walk(fn: Callable[..., Any], state: Any, *others: Any) -> Any:
    """``state`` rebuilt with each moment field replaced by ``fn(signed, field, *fields of
    others)`` (``others`` have ``state``'s containers); everything else as it is."""
    fields = _MOMENTS.get(type(state))
    if fields is not None:
        return state._replace(
            **{
                f: fn(s, getattr(state, f), *(getattr(o, f) for o in others))
                for f, s in fields.items()
            }
        )
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return type(state)(*(_walk(fn, *parts) for parts in zip(state, *others, strict=True)))
    if isinstance(state, (tuple, list)):
        return type(state)(_walk(fn, *parts) for parts in zip(state, *others, strict=True))
    if isinstance(state, dict):
        return {k: _walk(fn, v, *(o[k] for o in others)) for k, v in state.items()}
    return state


def _unknown(state: Any, shapes: set[tuple[int, ...]], owner: str = "its state") -> set[str]:
    """The optax states outside :data:`_MOMENTS` that hold a floating array of a parameter's
    shape: per-parameter state this module does not know how to quantize."""
    if type(state) in _MOMENTS:
        return set()
    if hasattr(state, "_fields"):
        owner = type(state).__name__
    if isinstance(state, dict):
        parts = list(state.values())
    elif isinstance(state, (tuple, list)):
        parts = list(state)
    else:
        floating = hasattr(state, "dtype") and jnp.issubdtype(state.dtype, jnp.floating)
        return {owner} if floating and state.size > 1 and tuple(state.shape) in shapes else set()
    return set().union(*(_unknown(part, shapes, owner) for part in parts))


# ---------------------------------------------------------------------- the transform


def quantized_state(
    tx: optax.GradientTransformation, state: str | StateFormat
) -> optax.GradientTransformation:
    """``tx`` with its moments kept in ``state``'s low-bit format between steps.

    Example::

        import jax.numpy as jnp
        import optax

        import mixprec.jax as mpj

        tx = mpj.quantized_state(optax.adamw(1e-3), "int8(min_size=0)")
        params = {"w": jnp.ones(300)}
        opt_state = tx.init(params)
        mu = opt_state[0].mu["w"]  # a QuantizedArray: uint8 codes, float32 absmax
        assert mu.codes.dtype == jnp.uint8 and mu.absmax.shape == (2,)  # 2 blocks of 256
        updates, opt_state = tx.update({"w": jnp.full(300, 0.1)}, opt_state, params)

    :param state: a low-bit format with its settings (``"int8"``,
        ``"int4(block=64,min_size=0,keep=*embed*)"``) or a :class:`~mixprec.StateFormat`.
    :raises WrapError: (from ``init``) ``tx`` keeps per-parameter state other than the
        moments named in :data:`SUPPORTED`, or a moment that is not float32 (``mu_dtype``).
    """
    fmt = parse_state_format(state) if isinstance(state, str) else state
    if fmt is None:
        raise WrapError(
            f"quantized_state needs a low-bit format ('int8', 'int4', 'fp8', with settings "
            f"such as 'int8(block=128)'), got {state!r}"
        )

    def encode_leaf(name: str, value: Any, signed: bool) -> Any:
        if not hasattr(value, "dtype") or value.shape == () or not fmt.quantizes(value.size, name):
            return value
        if value.dtype != jnp.float32:
            raise WrapError(
                f"state={fmt} quantizes float32 moments, but {name!r} keeps its moment in "
                f"{value.dtype} (the optimizer's mu_dtype?); drop mu_dtype, or drop state=..."
            )
        return quantize(value, fmt, signed)

    def init(params: PyTree) -> Any:
        inner = tx.init(params)
        shapes = {np.shape(p) for p in jax.tree_util.tree_leaves(params)}
        unknown = _unknown(inner, shapes)
        if unknown:
            raise WrapError(
                f"state={fmt} keeps optimizer moments in {fmt.bits} bits, which mixprec knows "
                f"how to do for {SUPPORTED}; this optimizer keeps per-parameter state in "
                f"{', '.join(sorted(unknown))}. Use one of those optimizers, or a policy "
                "without a low-bit state (drop state=...)"
            )
        names = jax.tree_util.tree_structure(params).unflatten(leaf_names(params))

        def encode(signed: bool, moment: PyTree) -> PyTree:
            return jax.tree_util.tree_map(
                lambda name, value: encode_leaf(name, value, signed), names, moment
            )

        return _walk(encode, inner)

    def update(updates: PyTree, opt_state: Any, params: PyTree = None) -> tuple[PyTree, Any]:
        def is_q(x: Any) -> bool:
            return isinstance(x, QuantizedArray)

        def decode(signed: bool, moment: PyTree) -> PyTree:
            return jax.tree_util.tree_map(
                lambda like, m: dequantize(m, fmt, signed, np.shape(like)) if is_q(m) else m,
                updates,
                moment,
                is_leaf=is_q,
            )

        def encode(signed: bool, new: PyTree, old: PyTree) -> PyTree:
            return jax.tree_util.tree_map(
                lambda o, n: quantize(n, fmt, signed) if is_q(o) else n, old, new, is_leaf=is_q
            )

        updates, inner = tx.update(updates, _walk(decode, opt_state), params)
        return updates, _walk(encode, inner, opt_state)

    return optax.GradientTransformation(init, update)


def _quantized(opt_state: Any) -> list[tuple[bool, QuantizedArray]]:
    """Every :class:`QuantizedArray` of a state, with its map's sign."""
    found: list[tuple[bool, QuantizedArray]] = []

    def collect(signed: bool, moment: PyTree) -> PyTree:
        leaves = jax.tree_util.tree_leaves(moment, is_leaf=lambda x: isinstance(x, QuantizedArray))
        found.extend((signed, q) for q in leaves if isinstance(q, QuantizedArray))
        return moment

    _walk(collect, opt_state)
    return found


def all_finite(opt_state: Any) -> jax.Array:
    """Whether every block absmax of ``opt_state`` is finite (traceable)."""
    ok = jnp.asarray(True)
    for _, q in _quantized(opt_state):
        ok = ok & jnp.all(jnp.isfinite(q.absmax))
    return ok


def check_codes(opt_state: Any, fmt: StateFormat) -> None:
    """Refuse a loaded state whose codes point beyond their map or whose absmax is negative
    (the checkpoint's checks saw the shapes, dtypes and inf/NaN already).

    :raises CheckpointError: naming the problem.
    """
    for signed, q in _quantized(opt_state):
        codes = np.asarray(q.codes)
        if fmt.bits == 4:
            codes = np.concatenate([codes & 15, codes >> 4])
        size = _table(fmt.name, signed)[0].size
        if (codes.size and int(codes.max()) >= size) or bool((np.asarray(q.absmax) < 0).any()):
            raise CheckpointError(
                f"the checkpoint's low-bit optimizer state holds a code beyond the {size} "
                f"values of the {fmt.name} map or a negative absmax; the file is damaged. "
                "Load an earlier one (nothing was loaded)"
            )
