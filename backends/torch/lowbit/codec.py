"""The block-wise low-bit codec: the C kernels' on the CPU, torch operations (the twin of the
NumPy reference ``mixprec_numpy.lowbit`` and of the C kernels, code for code) elsewhere.

The scheme and the maps are :mod:`mixprec.numerics.lowbit`'s (through the kit). Per block of
``fmt.block`` elements of a flat float32 tensor: ``a = max |x|``; ``n = x / a`` (a true
float32 division; 0 where ``a == 0``); ``code = #{mids < n}`` (``torch.searchsorted`` on
the float32 midpoints, left side); decoding is ``map[code] * a``. 4-bit codes are packed two
per byte, the even element in the low nibble. Every operation is exactly rounded, so the
twin, the NumPy reference and the C kernels give the same codes and the same decoded values.

:func:`quantize`, :func:`encode` and :func:`dequantize` run the C kernels
(:func:`mixprec_torch.cpu.clib.lowbit_quantize`, ``lowbit_dequantize``) for float32 CPU
tensors where the library is in use, and the twin (:func:`quantize_torch`,
:func:`dequantize_torch`) otherwise (``MIXPREC_NATIVE=0``, another device). The kernels
also count the blocks whose absmax is not finite, in the same pass (:func:`encode`). A code
the map does not have (a damaged checkpoint) decodes as NaN in the kernels, and is an
``IndexError`` in the twin.
"""

from __future__ import annotations

import ctypes

import torch

from mixprec.kit import StateFormat, state_map

from ..cpu import clib

__all__ = [
    "Tables",
    "absmax",
    "blocks_of",
    "code_count",
    "dequantize",
    "dequantize_torch",
    "encode",
    "quantize",
    "quantize_torch",
    "tables",
]


class Tables:
    """One format's maps and midpoints as float32 tensors on one device, and on the CPU what
    the kernels read (:meth:`native`)."""

    def __init__(self, fmt: StateFormat, signed: bool, device: torch.device) -> None:
        smap = state_map(fmt.name, signed)
        self.values = torch.tensor(smap.values, dtype=torch.float32, device=device)
        self.mids = torch.tensor(smap.mids, dtype=torch.float32, device=device)
        self.bits = fmt.bits
        self._native: clib.LowbitMap | None = None
        self._held: tuple[torch.Tensor, ...] = ()

    def native(self, lib: ctypes.CDLL) -> clib.LowbitMap:
        """The map as the kernels read it (CPU tables only): the values padded with NaN to
        ``2**bits`` entries (a code the map lacks decodes as NaN, never out of bounds), the
        midpoints and their search index, built once."""
        if self._native is None:
            padded = torch.full((1 << self.bits,), float("nan"), dtype=torch.float32)
            padded[: self.values.numel()] = self.values
            index = clib.lowbit_index(lib, self.mids)
            self._held = (padded, index)  # the struct points into them
            self._native = clib.LowbitMap(
                padded.data_ptr(),
                self.mids.data_ptr(),
                index.data_ptr(),
                self.mids.numel(),
                self.bits,
            )
        return self._native


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


def blocks_of(fmt: StateFormat, numel: int) -> int:
    """How many blocks (absmax values) a tensor of ``numel`` elements takes."""
    return -(-numel // fmt.block)


def _cpu_library(t: torch.Tensor) -> ctypes.CDLL | None:
    """The kernels for a float32 CPU tensor, None for anything else or where none are built."""
    if t.device.type != "cpu" or t.dtype != torch.float32:
        return None
    return clib.library()


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


def encode(
    x: torch.Tensor, fmt: StateFormat, signed: bool
) -> tuple[torch.Tensor, torch.Tensor, bool | torch.Tensor]:
    """:func:`quantize`, and whether every block's absmax is finite: a bool from the kernels
    (counted in the same pass), a 0-dim bool tensor on ``x``'s device from the twin (no sync
    here; stack several and ask once)."""
    lib = _cpu_library(x)
    if lib is None:
        codes, a = quantize_torch(x, fmt, signed)
        return codes, a, torch.isfinite(a).all()
    flat = x.reshape(-1).contiguous()
    numel = flat.numel()
    codes = torch.empty(code_count(fmt, numel), dtype=torch.uint8)
    a = torch.empty(blocks_of(fmt, numel), dtype=torch.float32)
    table = tables(fmt, signed, flat.device).native(lib)
    bad = clib.lowbit_quantize(lib, flat, fmt.block, table, codes, a)
    return codes, a, bad == 0


def quantize(x: torch.Tensor, fmt: StateFormat, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes (uint8, flat, packed for 4 bits) and per-block absmax of float32 ``x``
    (the kernels for a CPU tensor where they are in use, else :func:`quantize_torch`)."""
    codes, a, _ = encode(x, fmt, signed)
    return codes, a


def quantize_torch(
    x: torch.Tensor, fmt: StateFormat, signed: bool, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin of :func:`quantize`, with torch operations on ``x``'s device.

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
    """The float32 values (flat, ``numel`` elements; or written into ``out``, of ``numel``
    elements, and returned) that ``codes`` and ``a`` stand for: the kernels for CPU tensors
    where they are in use, else :func:`dequantize_torch`."""
    on_cpu = codes.device.type == "cpu" and a.device.type == "cpu"
    lib = clib.library() if on_cpu else None
    fits = (
        lib is not None
        and codes.dtype == torch.uint8
        and codes.numel() == code_count(fmt, numel)
        and a.is_floating_point()
        and a.numel() == blocks_of(fmt, numel)
        and (out is None or (_cpu_library(out) is not None and out.numel() == numel))
    )
    if lib is None or not fits:  # the twin (and its errors, for codes that do not fit)
        return dequantize_torch(codes, a, fmt, signed, numel, out)
    target = torch.empty(numel, dtype=torch.float32) if out is None else out
    flat = target if target.is_contiguous() else torch.empty(numel, dtype=torch.float32)
    table = tables(fmt, signed, codes.device).native(lib)
    clib.lowbit_dequantize(lib, codes.contiguous(), a.float().contiguous(), fmt.block, table, flat)
    if flat is not target:
        target.copy_(flat.view(target.shape))
    return target


def dequantize_torch(
    codes: torch.Tensor,
    a: torch.Tensor,
    fmt: StateFormat,
    signed: bool,
    numel: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The twin of :func:`dequantize`, with torch operations on the tensors' device."""
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
