"""Optimizer state in 8 and 4 bits, the readable reference: the codec and the step around it.

:mod:`mixprec.numerics.lowbit` defines the formats (``int8``, ``int4``, ``fp8``), their maps
and the block-wise scheme; this module is that scheme in NumPy, line by line, so the torch
twin (``mixprec_torch.lowbit.codec``), the C kernels and the JAX transform can be checked
against it bit for bit. Per block of ``fmt.block`` elements of a flat float32 array::

    a    = max |x|                        (float32)
    n    = x / a                          (float32 true division; 0 where a == 0)
    code = #{ i : mids[i] < n }           (np.searchsorted(mids, n, side="left"))
    x'   = values[code] * a               (float32)

4-bit codes are packed two per byte, the even element in the low nibble.

Under such a policy :class:`LowBitState` keeps the moments of the optimizer (the momentum
buffer of :class:`~mixprec_numpy.optimizer.SGD`) of every parameter the format quantizes as
codes and block absmax *between* steps: :meth:`LowBitState.update` decodes them into float32
arrays in ``optimizer.state``, lets the unchanged optimizer update them in float32 and
encodes them again. A skipped step never calls it, so the codes stay bit for bit; a moment
the optimizer did not touch (a parameter without a gradient) keeps its codes. A non-finite
moment is refused with :class:`~mixprec.errors.PolicyError` and the step undone (weights and
codes as they were): an inf absmax would decode as garbage.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol

import numpy as np

from mixprec.errors import CheckpointError, PolicyError, WrapError
from mixprec.kit import StateFormat, state_map
from mixprec_numpy.casting import Array
from mixprec_numpy.layers import Parameter

__all__ = [
    "LowBitState",
    "Quantized",
    "code_count",
    "dequantize",
    "pack",
    "quantize",
    "unpack",
]


class Quantized(NamedTuple):
    """One state array between steps."""

    codes: Array
    """uint8, flat: one code a byte, or two (``int4``: the even element in the low nibble)."""
    absmax: Array
    """float32, one per block: the block's largest magnitude."""


class _Moments(Protocol):
    """An optimizer whose state the low-bit layer can keep (the plugin's :class:`SGD`)."""

    state: dict[str, Array]

    def update(self, params: list[Parameter]) -> None: ...

    def moments(self, name: str) -> dict[str, bool]: ...


@functools.cache
def _table(name: str, signed: bool) -> tuple[Array, Array]:
    """The map's values and midpoints as float32 arrays."""
    smap = state_map(name, signed)
    return np.array(smap.values, np.float32), np.array(smap.mids, np.float32)


def code_count(fmt: StateFormat, numel: int) -> int:
    """How many bytes of codes an array of ``numel`` elements takes."""
    return (numel + 1) // 2 if fmt.bits == 4 else numel


def pack(codes: Array) -> Array:
    """4-bit codes two per byte: element ``2i`` in the low nibble, ``2i + 1`` in the high."""
    codes = np.asarray(codes, np.uint8)
    if codes.size % 2:
        codes = np.append(codes, np.uint8(0))
    return codes[0::2] | (codes[1::2] << np.uint8(4))  # type: ignore[no-any-return]


def unpack(packed: Array, numel: int) -> Array:
    """The ``numel`` 4-bit codes :func:`pack` stored."""
    pairs = np.stack([packed & np.uint8(15), packed >> np.uint8(4)], axis=1)
    return np.asarray(pairs.reshape(-1)[:numel])


def _blocks(flat: Array, block: int) -> Array:
    """``flat`` zero-padded to whole blocks, as (blocks, block)."""
    padded = np.zeros(-(-flat.size // block) * block, np.float32)
    padded[: flat.size] = flat
    return padded.reshape(-1, block)


def quantize(x: Array, fmt: StateFormat, signed: bool) -> Quantized:
    """The codes and block absmax of ``x`` (any shape, read as float32 in row-major order)
    under ``fmt``'s signed map (first moment, momentum) or unsigned one (second moment)."""
    flat = np.asarray(x, np.float32).reshape(-1)
    blocks = _blocks(flat, fmt.block)
    absmax = np.abs(blocks).max(axis=1, initial=np.float32(0))
    normal = np.zeros_like(blocks)
    with np.errstate(invalid="ignore", divide="ignore"):  # inf or NaN: the caller refuses it
        np.divide(blocks, absmax[:, None], out=normal, where=absmax[:, None] > 0)
    _, mids = _table(fmt.name, signed)
    codes = np.searchsorted(mids, normal.reshape(-1)[: flat.size], side="left").astype(np.uint8)
    return Quantized(pack(codes) if fmt.bits == 4 else codes, absmax)


def dequantize(q: Quantized, fmt: StateFormat, signed: bool, shape: Sequence[int] | int) -> Array:
    """The float32 array of ``shape`` that ``q`` stands for: ``values[code] * a``."""
    numel = int(np.prod(shape))
    index = unpack(q.codes, numel) if fmt.bits == 4 else q.codes
    values, _ = _table(fmt.name, signed)
    decoded = _blocks(values[index], fmt.block) * q.absmax[:, None]
    return np.asarray(decoded.reshape(-1)[:numel].reshape(shape))


class LowBitState:
    """The optimizer's moments as codes between steps, for one trainer (see the module).

    :param fmt: the policy's low-bit format.
    :param optimizer: the plugin's :class:`~mixprec_numpy.optimizer.SGD` (any optimizer
        with ``moments(name)``, the state keys of a parameter and whether each is signed).
    :param params: the parameters the optimizer updates (the masters, or the parameters).
    :raises WrapError: an optimizer that does not say which state it keeps.
    """

    def __init__(self, fmt: StateFormat, optimizer: _Moments, params: Sequence[Parameter]):
        if not callable(getattr(optimizer, "moments", None)):
            raise WrapError(
                f"state={fmt} keeps the optimizer's moments in {fmt.bits} bits, which the NumPy "
                f"backend knows how to do for its SGD (momentum), but the optimizer is "
                f"{type(optimizer).__name__}. Use mixprec_numpy.SGD, or a policy without a "
                "low-bit state (drop state=...)"
            )
        self.fmt = fmt
        self.optimizer = optimizer
        #: state key -> (the parameter's shape, signed map) of every quantized moment.
        self.layout: dict[str, tuple[tuple[int, ...], bool]] = {
            key: (p.data.shape, signed)
            for p in params
            if fmt.quantizes(p.data.size, p.name)
            for key, signed in optimizer.moments(p.name).items()
        }
        #: The codes of each quantized moment the optimizer has made so far, by state key.
        self.codes: dict[str, Quantized] = {}

    @property
    def state(self) -> dict[str, Array]:
        """The optimizer's float32 state (moments of unquantized parameters between steps)."""
        return self.optimizer.state

    def decode(self, key: str) -> Array:
        """The float32 value the codes of ``key`` stand for."""
        shape, signed = self.layout[key]
        return dequantize(self.codes[key], self.fmt, signed, shape)

    def update(self, params: list[Parameter]) -> None:
        """One optimizer step with the moments widened to float32 and encoded after.

        :raises PolicyError: the update made a moment inf or NaN; the parameters and the
            codes are left as they were before the step.
        """
        state = self.optimizer.state
        decoded = {key: self.decode(key) for key in self.codes}
        state.update(decoded)
        before = [p.data for p in params]  # the optimizer assigns new arrays
        try:
            self.optimizer.update(params)
            encoded = {
                key: quantize(state[key], self.fmt, self.layout[key][1])
                for key in self.layout
                if key in state
                # a moment the optimizer left alone keeps the codes it came from
                and not (key in decoded and np.array_equal(state[key], decoded[key]))
            }
            bad = next((k for k, q in encoded.items() if not np.isfinite(q.absmax).all()), None)
            if bad is not None:
                for p, data in zip(params, before, strict=True):
                    p.data = data
                raise PolicyError(
                    f"state={self.fmt}: the optimizer's update made the moment {bad!r} inf or "
                    "NaN, which a quantized state cannot hold (the step was undone). Lower the "
                    "learning rate or clip the gradients, or keep this parameter's state in "
                    f"float32 (state={self.fmt.name}(keep={bad}))"
                )
            self.codes.update(encoded)
        finally:
            for key in self.layout:
                state.pop(key, None)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Array]:
        """The codes and absmax of every quantized moment, as ``<key>/codes`` and
        ``<key>/absmax`` arrays."""
        out = {}
        for key, q in self.codes.items():
            out[f"{key}/codes"], out[f"{key}/absmax"] = q.codes.copy(), q.absmax.copy()
        return out

    def check_state_dict(
        self, saved: Mapping[str, Array], optimizer_state: Mapping[str, Array]
    ) -> dict[str, Quantized]:
        """The codes :meth:`state_dict` wrote, checked whole before anything changes.

        :param optimizer_state: the checkpoint's float32 optimizer state: it must not hold a
            moment the policy quantizes.
        :raises CheckpointError: a moment of no quantized parameter, codes or absmax missing,
            of the wrong dtype or size, codes beyond the map, an inf, NaN or negative absmax.
        """
        for key in optimizer_state:
            if key in self.layout:
                raise CheckpointError(
                    f"the checkpoint holds the optimizer state {key!r} in float32, but policy "
                    f"state={self.fmt} keeps it quantized; the file was not written by "
                    "Trainer.save under this policy"
                )
        found: dict[str, Quantized] = {}
        keys = {name.rpartition("/")[0] for name in saved}
        for key in sorted(keys):
            codes, absmax = saved.get(f"{key}/codes"), saved.get(f"{key}/absmax")
            if key not in self.layout or codes is None or absmax is None:
                raise CheckpointError(
                    f"the checkpoint's low-bit state {key!r} does not belong to a parameter "
                    f"this trainer quantizes under state={self.fmt}, or lacks its codes or "
                    "absmax; the file belongs to another model or is damaged"
                )
            shape, signed = self.layout[key]
            numel = int(np.prod(shape))
            blocks = -(-numel // self.fmt.block)
            if (
                codes.dtype != np.uint8
                or codes.shape != (code_count(self.fmt, numel),)
                or absmax.dtype != np.float32
                or absmax.shape != (blocks,)
            ):
                raise CheckpointError(
                    f"the checkpoint's low-bit state {key!r} does not fit its parameter of "
                    f"{numel} elements under state={self.fmt} (expected "
                    f"{code_count(self.fmt, numel)} uint8 codes and {blocks} float32 absmax); "
                    "the file belongs to another model or is damaged"
                )
            index = unpack(codes, numel) if self.fmt.bits == 4 else codes
            values, _ = _table(self.fmt.name, signed)
            if not (np.isfinite(absmax).all() and (absmax >= 0).all()) or (
                index.size and int(index.max()) >= values.size
            ):
                raise CheckpointError(
                    f"the checkpoint's low-bit state {key!r} holds an inf, NaN or negative "
                    f"absmax or a code beyond the {values.size} values of the map; the file "
                    "is damaged. Load an earlier one"
                )
            found[key] = Quantized(codes.copy(), absmax.copy())
        return found

    def load(self, codes: Mapping[str, Quantized]) -> None:
        """Take the codes :meth:`check_state_dict` returned."""
        self.codes = dict(codes)
