"""FP8, the readable reference: e4m3/e5m2/e8m0 rounding, the four recipes, the FP8 linear.

:mod:`mixprec.fp8` defines the arithmetic; this module is it in NumPy, one function per
step, so that a backend author can check theirs against it bit for bit (the torch backend's
tests do). FP8 values are stored in float32 arrays whose values are all representable in
the format, as :mod:`~mixprec_numpy.casting` stores bfloat16.

A GEMM ``a @ b`` reduces over ``a``'s last and ``b``'s first axis; every operand is
quantised along the axis it is reduced over (:func:`quantise`), so ``rowwise`` scales a row
of ``a`` and a column of ``b``, and ``mxfp8`` blocks run along those axes. The linear layer
``y = x @ w + b`` (``w`` is ``[in, out]`` here) runs three GEMMs (:func:`linear_forward`,
:func:`linear_backward`):

- forward ``x @ w``: ``x`` and ``w`` in e4m3;
- input gradient ``g @ w.T``: ``g`` in e5m2, ``w`` in e4m3 (reduced over the outputs);
- weight gradient ``x.T @ g``: ``x`` in e4m3, ``g`` in e5m2 (reduced over the batch).

Each GEMM multiplies the dequantised operands (``q * (1 / s)``, float32) and accumulates in
float32; the bias is added in float32.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from mixprec.kit import (
    BACKWARD_FORMAT,
    FORWARD_FORMAT,
    MX_BLOCK,
    DelayedScaling,
    FP8Recipe,
    format_info,
)
from mixprec_numpy.casting import Array, float32

__all__ = [
    "FP8Runtime",
    "Quantised",
    "amax_of",
    "dequantise",
    "e8m0_encode",
    "linear_backward",
    "linear_forward",
    "mx_exponents",
    "quantise",
    "round_to_fp8",
    "runtime_for",
    "tensor_scales",
]

_F32_MAX = np.float32(np.finfo(np.float32).max)


def round_to_fp8(y: Array, fmt: str) -> Array:
    """``y`` (float32 values) rounded to the FP8 format ``fmt``: to nearest, ties to even,
    subnormals kept, finite values beyond the largest saturating to it, non-finite values
    becoming NaN. A float32 array of format values."""
    info = format_info(fmt)
    y64 = np.asarray(y, dtype=np.float32).astype(np.float64)
    size = np.abs(y64)
    exponent = np.frexp(size)[1] - 1  # size = m * 2**exponent, 1 <= m < 2 (0 for zeros)
    quantum = np.where(
        size >= info.smallest_normal,
        np.ldexp(1.0, exponent - info.mantissa_bits),
        info.smallest_subnormal,
    )
    with np.errstate(invalid="ignore"):  # inf / quantum: replaced below
        rounded = np.minimum(np.rint(size / quantum) * quantum, info.max)  # rint: ties to even
    out = np.where(np.isfinite(y64), np.copysign(rounded, y64), np.nan)
    return out.astype(np.float32)


def tensor_scales(amax: Array, fmt: str, margin: int = 0) -> Array:
    """The float32 scale per amax: ``fmt_max / amax`` in float32, at most float32's largest,
    divided by ``2**margin``; 1.0 where ``amax`` is 0 or not finite."""
    amax = np.asarray(amax, dtype=np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        scale = np.minimum(np.float32(format_info(fmt).max) / amax, _F32_MAX)
    scale = np.ldexp(scale, -margin).astype(np.float32) if margin else scale
    return np.where(np.isfinite(amax) & (amax > 0), scale, np.float32(1.0)).astype(np.float32)


def mx_exponents(amax: Array, fmt: str) -> Array:
    """The exponent of each mxfp8 block scale ``2**e``: ``floor(log2(amax))`` minus the
    format's largest exponent, clamped to [-127, 127]; -127 for 0, 0 where not finite."""
    amax = np.asarray(amax, dtype=np.float32).astype(np.float64)
    emax = int(np.frexp(format_info(fmt).max)[1]) - 1
    finite = np.isfinite(amax)
    exponent = np.frexp(np.where(finite, amax, 1.0))[1] - 1 - emax
    exponent = np.where(amax == 0, -127, np.clip(exponent, -127, 127))
    return np.where(finite, exponent, 0).astype(np.int32)


def e8m0_encode(exponent: Array) -> Array:
    """The e8m0 byte of a power-of-two scale ``2**exponent``: ``exponent + 127``."""
    return (np.asarray(exponent, dtype=np.int32) + 127).astype(np.uint8)


class Quantised(NamedTuple):
    """An operand in FP8: its format values ``q``, the scale ``s`` they were multiplied by
    and the dequantising factor ``inverse = 1 / s`` (both broadcast against ``q``)."""

    q: Array
    scale: Array
    inverse: Array


def _blocks(x: Array, axis: int) -> tuple[Array, int]:
    """``x`` with ``axis`` moved last, padded with zeros to whole blocks and split into
    ``[..., blocks, MX_BLOCK]``; and the unpadded length."""
    moved = np.moveaxis(x, axis, -1)
    length = moved.shape[-1]
    pad = -length % MX_BLOCK
    padded = np.pad(moved, [(0, 0)] * (moved.ndim - 1) + [(0, pad)])
    return padded.reshape(*moved.shape[:-1], -1, MX_BLOCK), length


def _unblock(blocked: Array, length: int, axis: int) -> Array:
    flat = blocked.reshape(*blocked.shape[:-2], -1)[..., :length]
    return np.moveaxis(flat, -1, axis)


def quantise(x: Array, fmt: str, recipe: str, axis: int, scale: float | None = None) -> Quantised:
    """``x`` in ``fmt`` under ``recipe``, scaled along the reduction ``axis``.

    ``tensorwise`` and ``delayed``: one scale for the tensor (``delayed`` passes its
    history's ``scale``; None means the tensor has no history yet and is scaled by its own
    amax); ``rowwise``: one per slice along ``axis``; ``mxfp8``: one power of two per block
    of :data:`~mixprec.fp8.MX_BLOCK` along ``axis``.
    """
    x = float32(np.asarray(x))
    magnitude = np.abs(x)
    if recipe == "mxfp8":
        blocked, length = _blocks(magnitude, axis)
        exponent = mx_exponents(blocked.max(axis=-1, keepdims=True), fmt)
        ones = np.ones_like(blocked)
        s = _unblock(np.ldexp(ones, -exponent).astype(np.float32), length, axis)
        inverse = _unblock(np.ldexp(ones, exponent).astype(np.float32), length, axis)
    else:
        if recipe == "rowwise":
            amax = magnitude.max(axis=axis, keepdims=True) if x.size else np.zeros(())
        else:
            amax = np.asarray(magnitude.max() if x.size else 0.0, np.float32)
        s = tensor_scales(amax, fmt) if scale is None else np.asarray(scale, np.float32)
        with np.errstate(divide="ignore"):
            inverse = (np.float32(1.0) / s).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        y = (x * s).astype(np.float32)
    return Quantised(round_to_fp8(y, fmt), s, inverse)


def dequantise(quantised: Quantised) -> Array:
    """``q * (1 / s)`` in float32: the values the GEMM multiplies."""
    with np.errstate(over="ignore", invalid="ignore"):
        return (quantised.q * quantised.inverse).astype(np.float32)  # type: ignore[no-any-return]


def amax_of(x: Array) -> float:
    """The largest ``|x|`` (float32), NaN when ``x`` holds a NaN, 0.0 for an empty array."""
    return float(np.abs(float32(np.asarray(x))).max()) if np.size(x) else 0.0


@dataclass
class FP8Runtime:
    """What a model's FP8 layers share during training: the recipe, the delayed scaling
    state (``delayed`` only) and the amaxes the running step recorded, which
    :meth:`settle` commits after the step (or drops when it was skipped)."""

    recipe: FP8Recipe
    delayed: DelayedScaling | None = None
    pending: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.recipe.name == "delayed" and self.delayed is None:
            self.delayed = DelayedScaling.for_recipe(self.recipe)

    def scale(self, name: str, fmt: str) -> float | None:
        """The delayed scale of tensor ``name`` (None: no history, or not ``delayed``)."""
        return None if self.delayed is None else self.delayed.scale(name, fmt)

    def record(self, name: str, x: Array) -> None:
        """Note ``x``'s amax for tensor ``name`` (the largest one of the step is kept)."""
        if self.delayed is None:
            return
        amax = amax_of(x)
        seen = self.pending.get(name)
        self.pending[name] = amax if seen is None or not amax <= seen else seen

    def finite(self) -> bool:
        """Whether every amax the running step recorded is finite."""
        return all(np.isfinite(a) for a in self.pending.values())

    def settle(self, skipped: bool) -> tuple[str, ...]:
        """After a step: commit the recorded amaxes (dropped when ``skipped``); return the
        tensors whose amax was refused as non-finite."""
        pending, self.pending = self.pending, {}
        if self.delayed is None:
            return ()
        self.delayed, refused = self.delayed.update(pending, skipped)
        return refused


def _operand(
    x: Array, fmt: str, recipe: str, axis: int, name: str, runtime: FP8Runtime | None
) -> Array:
    scale = None
    if runtime is not None and recipe == "delayed":
        runtime.record(name, x)
        scale = runtime.scale(name, fmt)
    return dequantise(quantise(x, fmt, recipe, axis, scale))


def linear_forward(
    x: Array, w: Array, b: Array | None, recipe: str, name: str, runtime: FP8Runtime | None
) -> Array:
    """``x @ w + b`` as an FP8 GEMM (float32 result; ``w`` is ``[in, out]``)."""
    xq = _operand(x, FORWARD_FORMAT, recipe, 1, f"{name}:input", runtime)
    wq = _operand(w, FORWARD_FORMAT, recipe, 0, f"{name}:weight", runtime)
    y = xq @ wq
    return y if b is None else y + float32(b)  # type: ignore[no-any-return]


def linear_backward(
    g: Array, x: Array, w: Array, recipe: str, name: str, runtime: FP8Runtime | None
) -> tuple[Array, Array]:
    """The input and weight gradients of :func:`linear_forward` (float32), from the output
    gradient ``g``: ``g`` in e5m2, ``x`` and ``w`` in e4m3, each along its reduction axis."""
    role = f"{name}:grad_output"
    per_tensor = recipe in ("tensorwise", "delayed")
    g_rows = _operand(g, BACKWARD_FORMAT, recipe, 1, role, runtime)
    # per-tensor scales do not depend on the axis: the second GEMM reuses the first's g
    g_cols = g_rows if per_tensor else _operand(g, BACKWARD_FORMAT, recipe, 0, role, None)
    scale_w = runtime.scale(f"{name}:weight", FORWARD_FORMAT) if runtime is not None else None
    scale_x = runtime.scale(f"{name}:input", FORWARD_FORMAT) if runtime is not None else None
    w_used = dequantise(quantise(w, FORWARD_FORMAT, recipe, 1, scale_w))
    x_used = dequantise(quantise(x, FORWARD_FORMAT, recipe, 0, scale_x))
    return g_rows @ w_used.T, x_used.T @ g_cols


def runtime_for(
    recipe: FP8Recipe | None, saved: Mapping[str, object] | None = None
) -> FP8Runtime | None:
    """A fresh :class:`FP8Runtime` for ``recipe`` (None without FP8), its delayed state
    from ``saved`` (:meth:`DelayedScaling.state_dict` form) when given."""
    if recipe is None:
        return None
    delayed = DelayedScaling.from_state_dict(saved) if saved is not None else None
    return FP8Runtime(recipe, delayed)
