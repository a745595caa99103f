"""The block-wise low-bit codec as torch operations: the twin of the NumPy reference
(``mixprec_numpy.lowbit``) and of the C kernels, code for code.

The scheme and the maps are :mod:`mixprec.numerics.lowbit`'s (through the kit). Per block of
``fmt.block`` elements of a flat float32 tensor: ``a = max |x|``; ``n = x / a`` (a true
float32 division; 0 where ``a == 0``); ``code = #{mids < n}`` (``torch.searchsorted`` on
the float32 midpoints, left side); decoding is ``map[code] * a``. 4-bit codes are packed two
per byte, the even element in the low nibble. Every operation is exactly rounded, so the
twin, the NumPy reference and the C kernels give the same codes and the same decoded values.
"""

from __future__ import annotations

import torch

from mixprec.kit import StateFormat, state_map

__all__ = ["Tables", "code_count", "dequantize", "quantize"]


class Tables:
    """One format's maps and midpoints as float32 tensors on one device."""

    def __init__(self, fmt: StateFormat, signed: bool, device: torch.device) -> None:
        smap = state_map(fmt.name, signed)
        self.values = torch.tensor(smap.values, dtype=torch.float32, device=device)
        self.mids = torch.tensor(smap.mids, dtype=torch.float32, device=device)


_TABLES: dict[tuple[str, bool, torch.device], Tables] = {}


def tables(fmt: StateFormat, signed: bool, device: torch.device) -> Tables:
    key = (fmt.name, signed, device)
    found = _TABLES.get(key)
    if found is None:
        found = _TABLES[key] = Tables(fmt, signed, device)
    return found


def code_count(fmt: StateFormat, numel: int) -> int:
    """How many bytes of codes a tensor of ``numel`` elements takes."""
    return (numel + 1) // 2 if fmt.bits == 4 else numel


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` (flat) zero-padded to whole blocks, as (blocks, block)."""
    pad = (-x.numel()) % block
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(-1, block)


def absmax(x: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """Each block's largest magnitude (float32; NaN where the block holds one)."""
    blocks = _blocks(x.reshape(-1), fmt.block)
    return blocks.abs().amax(dim=1)


def quantize(
    x: torch.Tensor, fmt: StateFormat, signed: bool, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes (uint8, flat, packed for 4 bits) and per-block absmax of float32 ``x``.

    :param scale: the blocks' absmax when already computed (:func:`absmax`).
    """
    flat = x.reshape(-1)
    numel = flat.numel()
    blocks = _blocks(flat, fmt.block)
    a = blocks.abs().amax(dim=1) if scale is None else scale
    divisor = torch.where(a > 0, a, torch.ones_like(a))  # a == 0: the block is all zeros
    normal = blocks / divisor[:, None]
    codes = torch.searchsorted(tables(fmt, signed, x.device).mids, normal.reshape(-1))
    codes = codes[:numel].to(torch.uint8)
    if fmt.bits == 4:
        if numel % 2:
            codes = torch.cat([codes, codes.new_zeros(1)])
        codes = codes[0::2] | (codes[1::2] << 4)
    return codes, a


def dequantize(
    codes: torch.Tensor,
    a: torch.Tensor,
    fmt: StateFormat,
    signed: bool,
    numel: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The float32 values (flat, ``numel`` elements) that ``codes`` and ``a`` stand for."""
    if fmt.bits == 4:
        index = torch.stack([codes & 15, codes >> 4], dim=1).reshape(-1)[:numel]
    else:
        index = codes
    values = tables(fmt, signed, codes.device).values[index.long()]
    pad = (-numel) % fmt.block
    if pad:
        values = torch.cat([values, values.new_zeros(pad)])
    decoded = (values.view(-1, fmt.block) * a[:, None]).reshape(-1)[:numel]
    if out is None:
        return decoded
    return out.copy_(decoded.view(out.shape))
