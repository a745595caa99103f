"""FP8 quantisation and GEMMs in PyTorch: :mod:`mixprec.fp8`'s arithmetic, bit for bit.

:func:`quantise` turns an operand into its FP8 values and dequantising factors under a
recipe, along the GEMM's reduction dimension; :func:`scaled_gemm` multiplies two quantised
operands, with ``torch._scaled_mm`` where the device runs it for the recipe (:class:`Native`,
probed once per device) and else by *exact emulation*: the dequantised operands
``q * (1 / s)`` multiplied in float32 and rounded once to the output dtype. On the CPU
``torch._scaled_mm`` computes exactly that, so both paths give the same bits there; on CUDA
the tensor cores accumulate differently (the quantised operands are the same).

Everything here is plain tensor code, with no data-dependent Python branch, so that
``torch.compile`` traces it in one graph (the branches on an empty operand read its shape,
which a compiled graph guards on).

**Empty operands** (a batch of zero rows, and so a weight gradient reduced over zero rows)
quantise to empty FP8 tensors with a scale of 1, and their GEMMs give the empty output, or
the zero gradient, that a float32 GEMM gives. An empty tensor has no amax: its amax is
-1, "did not run", so the delayed recipe's histories never record one for it.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from mixprec.kit import MX_BLOCK, format_info

from ..torch_private import has_scaled_mm, scaled_mm

__all__ = [
    "FP8_TORCH_DTYPES",
    "Native",
    "Quantised",
    "dequantise",
    "native_gemms",
    "quantise",
    "quantise_tensor",
    "scaled_gemm",
    "tensor_scale",
]

#: The torch dtype of each FP8 format mixprec uses.
FP8_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
_F32_MAX = float(torch.finfo(torch.float32).max)
# Python constants, read at import: nothing is looked up while torch.compile traces
_MAX = {fmt: format_info(fmt).max for fmt in FP8_TORCH_DTYPES}
_EMAX = {fmt: math.frexp(top)[1] - 1 for fmt, top in _MAX.items()}  # 448 = 1.75 * 2**8


class Quantised(NamedTuple):
    """An operand in FP8: ``q`` (an FP8 tensor of the operand's shape), ``inverse``, the
    float32 factor that dequantises it (``1 / s``; a scalar, one per row along the
    reduction dimension, or one per element for mxfp8, each constant over its block), and
    ``scale``, the ``s`` it was multiplied by (same shape)."""

    q: torch.Tensor
    inverse: torch.Tensor
    scale: torch.Tensor


def tensor_scale(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """``fmt_max / amax`` in float32 (true division, correctly rounded), at most float32's
    largest; 1.0 where ``amax`` is 0 or not finite."""
    top = torch.full_like(amax, _MAX[fmt])
    scale = torch.clamp(top / amax, max=_F32_MAX)
    usable = torch.isfinite(amax) & (amax > 0)
    return torch.where(usable, scale, torch.ones_like(amax))


def _round(y: torch.Tensor, fmt: str) -> torch.Tensor:
    """``y`` (float32) in the format: finite values saturate, non-finite ones become NaN."""
    top = _MAX[fmt]
    saturated = torch.where(torch.isfinite(y), y.clamp(-top, top), torch.full_like(y, torch.nan))
    return saturated.to(FP8_TORCH_DTYPES[fmt])


def _mx_exponent(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    exponent = (torch.frexp(amax)[1] - 1 - _EMAX[fmt]).clamp(-127, 127)
    exponent = torch.where(amax == 0, torch.full_like(exponent, -127), exponent)
    return torch.where(torch.isfinite(amax), exponent, torch.zeros_like(exponent))


def _quantise_blocks(x: torch.Tensor, fmt: str, dim: int) -> Quantised:
    moved = x.movedim(dim, -1)
    length = moved.shape[-1]
    pad = -length % MX_BLOCK
    padded = F.pad(moved, (0, pad)) if pad else moved
    # the block count spelt out: with no element at all, -1 would be ambiguous
    blocks = padded.reshape(*padded.shape[:-1], padded.shape[-1] // MX_BLOCK, MX_BLOCK)
    exponent = _mx_exponent(blocks.abs().amax(dim=-1, keepdim=True), fmt).float()
    scale = torch.exp2(-exponent)
    q = _round(blocks * scale, fmt)  # exact: a power of two
    inverse = torch.exp2(exponent).expand(blocks.shape)

    def back(t: torch.Tensor) -> torch.Tensor:
        flat = t.reshape(padded.shape)
        return (flat[..., :length] if pad else flat).movedim(-1, dim)

    return Quantised(back(q), back(inverse), back(scale.expand(blocks.shape)))


def quantise_tensor(
    x: torch.Tensor, fmt: str, recipe: str, scale: torch.Tensor | None = None
) -> tuple[Quantised, torch.Tensor]:
    """``x`` in ``fmt`` with one scale (tensorwise, or delayed's ``scale``: a float32 scalar
    tensor, 0 meaning no history yet, so the tensor's own amax scales it), and its amax
    (-1 for an empty ``x``: nothing ran, nothing for a history)."""
    x32 = x.float()
    amax = x32.abs().amax() if x32.numel() else x32.new_full((), -1.0)
    s = tensor_scale(amax, fmt)
    if scale is not None and recipe == "delayed":
        s = torch.where(scale > 0, scale, s)
    return Quantised(_round(x32 * s, fmt), torch.reciprocal(s), s), amax


def quantise(
    x: torch.Tensor, fmt: str, recipe: str, dim: int, scale: torch.Tensor | None = None
) -> Quantised:
    """``x`` in ``fmt`` under ``recipe``, scaled along the reduction dimension ``dim``.

    :param scale: the ``delayed`` recipe's scale (see :func:`quantise_tensor`); ignored by
        the other recipes.
    """
    if recipe == "mxfp8":
        return _quantise_blocks(x.float(), fmt, dim)
    if recipe == "rowwise":
        x32 = x.float()
        s = tensor_scale(_row_amax(x32, dim), fmt)
        return Quantised(_round(x32 * s, fmt), torch.reciprocal(s), s)
    return quantise_tensor(x, fmt, recipe, scale)[0]


def _row_amax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The amax of each row along ``dim`` (kept as a dimension of 1); 0, which scales by 1,
    for rows of no element (torch refuses to reduce an empty dimension)."""
    if x.shape[dim]:
        return x.abs().amax(dim=dim, keepdim=True)
    shape = list(x.shape)
    shape[dim] = 1
    return x.new_zeros(shape)


def dequantise(quantised: Quantised) -> torch.Tensor:
    """``q * (1 / s)`` in float32: the operand the emulated GEMM multiplies."""
    return quantised.q.float() * quantised.inverse


class Native(NamedTuple):
    """Which GEMMs ``torch._scaled_mm`` runs on one device: per-tensor scales (tensorwise,
    delayed) and per-row scales (rowwise). mxfp8 is always emulated."""

    tensor: bool
    row: bool

    def runs(self, recipe: str) -> bool:
        """Whether ``recipe``'s GEMMs run natively here."""
        if recipe == "rowwise":
            return self.row
        return self.tensor and recipe in ("tensorwise", "delayed")


def _probe(device: torch.device, row: bool) -> bool:
    """Whether ``torch._scaled_mm`` runs the three GEMM shapes of an FP8 linear here."""
    try:
        a = torch.ones(16, 32, device=device)
        b = torch.ones(16, 32, device=device)
        for fmt_a in ("float8_e4m3fn", "float8_e5m2"):
            qa = quantise(a, fmt_a, "rowwise" if row else "tensorwise", 1)
            qb = quantise(b, "float8_e4m3fn", "rowwise" if row else "tensorwise", 1)
            out = _native(qa, qb, torch.bfloat16)
            if not bool(torch.isfinite(out).all()):
                return False
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False
    return True


@functools.cache
def native_gemms(device_type: str, index: int | None = None) -> Native:
    """What ``torch._scaled_mm`` runs on this device (probed once, with tiny GEMMs)."""
    if not has_scaled_mm():
        return Native(False, False)
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    return Native(_probe(device, row=False), _probe(device, row=True))


def _native(a: Quantised, b: Quantised, out: torch.dtype) -> torch.Tensor:
    # a [M, K] and b [N, K], both scaled along K: _scaled_mm wants a row-major and b as
    # [K, N] column-major, the scales as [M, 1] and [1, N] (or scalars)
    scale_b = b.inverse.t() if b.inverse.dim() == 2 else b.inverse
    return scaled_mm(a.q.contiguous(), b.q.contiguous().t(), a.inverse, scale_b, out)


def _fits_native(a: Quantised, b: Quantised) -> bool:
    # an empty GEMM (a batch of no rows) is emulated: its product is empty, or zero
    if 0 in (*a.q.shape, b.q.shape[0]):
        return False
    # CUDA's FP8 kernels need every dimension to be a multiple of 16
    if a.q.device.type != "cuda":
        return True
    return all(d % 16 == 0 for d in (*a.q.shape, b.q.shape[0]))


def scaled_gemm(
    a: Quantised,
    b: Quantised,
    bias: torch.Tensor | None,
    out: torch.dtype,
    *,
    native: bool,
) -> torch.Tensor:
    """``a @ b.T (+ bias)`` in ``out``: ``a`` is ``[M, K]``, ``b`` is ``[N, K]``, both
    quantised along K. ``native``: through ``torch._scaled_mm`` (where the shapes fit it);
    else the dequantised operands multiplied in float32. Either way the bias is added in
    float32 and the result rounded once to ``out``."""
    if native and _fits_native(a, b):
        if bias is None:
            return _native(a, b, out)
        product = _native(a, b, torch.float32)
    else:
        product = torch.mm(dequantise(a), dequantise(b).t())
    return (product if bias is None else product + bias.float()).to(out)
