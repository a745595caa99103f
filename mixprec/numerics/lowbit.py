"""Optimizer state in 8 and 4 bits: the formats, their maps and the block-wise scheme.

A policy's ``state`` item may name a *low-bit format*: ``int8``, ``int4`` or ``fp8``. Under
any master strategy whose optimizer updates float32 tensors (``O0``'s float32 weights,
``O2``/``O2-bf16``'s float32 masters, the compensated strategies' float32 working masters)
the optimizer's per-parameter floating state (Adam's ``exp_avg`` and ``exp_avg_sq``, SGD's
``momentum_buffer``) is kept *quantized* between steps and widened to float32 inside
``step()``; the optimizer's own update runs in float32 as before.

The scheme (one for all three formats; Dettmers et al. 2022, "8-bit Optimizers via Block-wise
Quantization"; Li et al. 2023, "Memory Efficient Optimizers with 4-bit States")
    A state tensor is flattened in row-major order and cut into *blocks* of ``block``
    elements (the last one may be shorter). Each block keeps its ``absmax`` (the largest
    ``|x|``, float32) and one *code* per element: the index of the nearest value of a sorted
    *map* of normalised values in ``[-1, 1]`` (signed tensors) or ``(0, 1]`` (the second
    moment). In exact float32 arithmetic, with ``a`` the block's absmax::

        n    = x / a                       (0 when a == 0)
        code = #{ i : mids[i] < n }         (mids: the map's midpoints, float32 data)
        x'   = map[code] * a

    so a tie goes to the lower code, and the block's largest element is stored exactly
    (every map holds ``1.0``, or ``-1.0`` and ``1.0``). The maps and midpoints are data
    (:func:`state_map`), so the NumPy reference, the torch twin and the C kernels give the
    same codes bit for bit. 4-bit codes are packed two per byte, the even element in the low
    nibble.

The maps
    ``int8``, signed (first moment, momentum): a *dynamic* map of 255 values, 0 and ±127
    magnitudes spread over seven decades: decade ``e`` (``10**-e`` down to ``10**-(e+1)``)
    holds ``2**(6-e)`` linearly spaced values, so the precision is finest near the block's
    absmax and the range reaches ``1e-6``. Unsigned (second moment): the same with 255
    positive magnitudes over eight decades, down to ``1e-7``, and no zero.
    ``int4``, signed: 15 values, 0 and ±7 over three decades (``0.01 .. 1``); unsigned: the
    *zero-free power-of-two* map ``2**-15 .. 2**0`` (16 values). Zero-free, as Li et al.
    2023 advise (a second moment rounded to zero makes ``m / (sqrt(v) + eps)`` explode);
    powers of two rather than their linear ``(j + 1) / 16``, because the second moment
    spans many octaves within a block and its *relative* error is what reaches the step:
    on the digits CNN (AdamW, 220 steps) the linear map ended at 2.3x float32 state's
    loss, this one at 0.94x (``benchmarks/lowbit_state.py``; the experiment in the
    CHANGELOG).
    ``fp8``: the finite values of ``float8_e4m3fn`` for signed tensors and of
    ``float8_e5m2`` (the wider range a squared gradient needs; its positive values only, so
    zero-free) for the second moment, each divided by its largest finite value, so the
    block's absmax lands on it.

Which tensors
    Floating state tensors of the parameter's shape (never the ``step`` counters) of
    parameters with at least ``min_size`` elements (default 4096, bitsandbytes'
    ``min_8bit_size``), except the parameters ``keep`` names (fnmatch patterns over the
    parameter's qualified name, e.g. ``keep=*embed*``: bitsandbytes' advice to keep an
    embedding's state in 32 bits): those stay float32.

Spec form: ``state=int8``, or with settings
``state=int8(block=128,min_size=0,keep=*embed*|lm_head.*)``.
"""

from __future__ import annotations

import fnmatch
import functools
import itertools
import math
import struct
from dataclasses import dataclass
from typing import Final

from mixprec.errors import PolicyError

__all__ = [
    "DEFAULT_BLOCK",
    "DEFAULT_MIN_SIZE",
    "LOWBIT_FORMATS",
    "SIGNED_KEYS",
    "UNSIGNED_KEYS",
    "StateFormat",
    "StateMap",
    "describe_lowbit",
    "lowbit_format",
    "parse_state_format",
    "state_bytes",
    "state_map",
]

INT8: Final = "int8"
INT4: Final = "int4"
FP8: Final = "fp8"
#: The low-bit formats a policy's ``state`` may name.
LOWBIT_FORMATS: tuple[str, ...] = (INT8, INT4, FP8)
#: The default block size per format (elements per absmax).
DEFAULT_BLOCK: dict[str, int] = {INT8: 256, INT4: 128, FP8: 256}
#: Parameters with fewer elements keep float32 state (bitsandbytes' ``min_8bit_size``).
DEFAULT_MIN_SIZE: Final = 4096
#: The state keys quantized with the signed map, and the one with the unsigned map. Any
#: other floating state key of the parameter's shape makes the optimizer unsupported.
SIGNED_KEYS: tuple[str, ...] = ("exp_avg", "momentum_buffer")
UNSIGNED_KEYS: tuple[str, ...] = ("exp_avg_sq", "max_exp_avg_sq")
_BLOCKS = tuple(2**k for k in range(5, 13))  # 32 .. 4096
_SETTINGS = ("block", "min_size", "keep")


def _f32(x: float) -> float:
    """``x`` rounded to the nearest float32, as a Python float."""
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


@dataclass(frozen=True)
class StateFormat:
    """A low-bit state format with its settings (see the module)."""

    name: str
    block: int
    min_size: int = DEFAULT_MIN_SIZE
    keep: tuple[str, ...] = ()

    @property
    def bits(self) -> int:
        return 4 if self.name == INT4 else 8

    def quantizes(self, numel: int, name: str | None) -> bool:
        """Whether a parameter of ``numel`` elements named ``name`` gets low-bit state."""
        if numel < self.min_size:
            return False
        return name is None or not any(fnmatch.fnmatchcase(name, p) for p in self.keep)

    def __str__(self) -> str:
        items = []
        if self.block != DEFAULT_BLOCK[self.name]:
            items.append(f"block={self.block}")
        if self.min_size != DEFAULT_MIN_SIZE:
            items.append(f"min_size={self.min_size}")
        if self.keep:
            items.append(f"keep={'|'.join(self.keep)}")
        return f"{self.name}({','.join(items)})" if items else self.name


_FORMS = (
    "state='int8', 'int4' or 'fp8', optionally with settings, e.g. "
    "'int8(block=256,min_size=4096,keep=*embed*)'"
)


def _setting(fmt: str, key: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = -1
    if key == "block" and number not in _BLOCKS:
        raise PolicyError(
            f"state={fmt}: block={value!r} is not a block size; use a power of two from "
            f"{_BLOCKS[0]} to {_BLOCKS[-1]} (default {DEFAULT_BLOCK[fmt]})"
        )
    if key == "min_size" and number < 0:
        raise PolicyError(
            f"state={fmt}: min_size={value!r} is not a size; use a non-negative integer "
            f"(elements; default {DEFAULT_MIN_SIZE}, 0 quantizes every tensor)"
        )
    return number


@functools.lru_cache(maxsize=256)
def parse_state_format(text: str) -> StateFormat | None:
    """The :class:`StateFormat` a ``state`` item names, or None when it names no low-bit
    format (``"bfloat16"``, ``"none"``: :func:`mixprec.numerics.compensated.check_state`'s
    business).

    :raises PolicyError: a low-bit format with an unknown setting, a bad block size, a
        negative ``min_size`` or an empty ``keep`` pattern.
    """
    text = text.strip()
    name, paren, rest = text.partition("(")
    name = name.strip().lower()
    if name not in LOWBIT_FORMATS:
        return None
    if paren and not rest.endswith(")"):
        raise PolicyError(f"state={text!r}: unbalanced parentheses; write {_FORMS}")
    settings: dict[str, str] = {}
    for item in rest[:-1].split(",") if paren else ():
        key, sep, value = (part.strip() for part in item.partition("="))
        if not item.strip():
            continue
        if not sep or key not in _SETTINGS or key in settings:
            problem = "repeated" if key in settings else "unknown"
            raise PolicyError(
                f"state={text!r}: {problem} setting {item.strip()!r}; the settings are "
                f"{', '.join(_SETTINGS)}: {_FORMS}"
            )
        settings[key] = value
    keep = tuple(p.strip() for p in settings.get("keep", "").split("|") if p.strip())
    if "keep" in settings and not keep:
        raise PolicyError(
            f"state={text!r}: keep= names no parameter; give fnmatch patterns over parameter "
            "names separated by '|', e.g. keep=*embed*|lm_head.weight"
        )
    return StateFormat(
        name,
        _setting(name, "block", settings["block"]) if "block" in settings else DEFAULT_BLOCK[name],
        _setting(name, "min_size", settings["min_size"])
        if "min_size" in settings
        else DEFAULT_MIN_SIZE,
        keep,
    )


def lowbit_format(text: str) -> StateFormat:
    """The :class:`StateFormat` ``text`` names, for callers that need a low-bit one.

    :raises PolicyError: ``text`` names no low-bit format (or a bad setting of one).
    """
    fmt = parse_state_format(text)
    if fmt is None:
        raise PolicyError(f"{text!r} is not a low-bit format; use one of {LOWBIT_FORMATS}")
    return fmt


# ---------------------------------------------------------------------------- the maps


def _dynamic(decades: int, top: int) -> list[float]:
    """Positive magnitudes: decade ``e`` (``0 .. decades-1``) holds ``2**(top-e)`` values
    ``10**-e * (0.1 + 0.9 * (j + 1) / n)``, so ``1.0`` is the largest."""
    values = []
    for e in range(decades):
        n = 2 ** (top - e)
        values += [10.0**-e * (0.1 + 0.9 * (j + 1) / n) for j in range(n)]
    return sorted(_f32(v) for v in values)


def _float8(exponent_bits: int, mantissa_bits: int, finite_nan_only: bool) -> list[float]:
    """The positive finite values of a float8 format (subnormals included), ascending."""
    bias = 2 ** (exponent_bits - 1) - 1
    values = []
    for e in range(2**exponent_bits):
        for m in range(2**mantissa_bits):
            if e == 2**exponent_bits - 1:
                if not finite_nan_only or m == 2**mantissa_bits - 1:
                    continue  # e5m2: inf/nan; e4m3fn: only the all-ones pattern is nan
            if e == 0 and m == 0:
                continue
            if e == 0:
                values.append(m / 2**mantissa_bits * 2.0 ** (1 - bias))
            else:
                values.append((1 + m / 2**mantissa_bits) * 2.0 ** (e - bias))
    return sorted(values)


@dataclass(frozen=True)
class StateMap:
    """A sorted map of normalised float32 values and its float32 midpoints (tuples of
    Python floats that are float32 values)."""

    values: tuple[float, ...]
    mids: tuple[float, ...]

    @classmethod
    def of(cls, values: list[float]) -> StateMap:
        values = sorted(_f32(v) for v in values)
        if len(set(values)) != len(values) or max(abs(v) for v in values) != 1.0:
            raise AssertionError("a state map holds distinct values with largest magnitude 1")
        mids = tuple(_f32((a + b) * 0.5) for a, b in itertools.pairwise(values))
        return cls(tuple(values), mids)


@functools.cache
def state_map(fmt: str, signed: bool) -> StateMap:
    """The map of ``fmt`` for a signed tensor (first moment, momentum) or the unsigned
    second moment (see the module)."""
    if fmt == INT8:
        if signed:
            mags = _dynamic(7, 6)  # 127 magnitudes
            return StateMap.of([-m for m in mags] + [0.0] + mags)
        return StateMap.of(_dynamic(8, 7))  # 255 magnitudes, no zero
    if fmt == INT4:
        if signed:
            mags = _dynamic(3, 2)  # 7 magnitudes
            return StateMap.of([-m for m in mags] + [0.0] + mags)
        return StateMap.of([2.0 ** (j - 15) for j in range(16)])
    if fmt == FP8:
        if signed:
            mags = _float8(4, 3, finite_nan_only=True)
            mags = [m / mags[-1] for m in mags]
            return StateMap.of([-m for m in mags] + [0.0] + mags)
        mags = _float8(5, 2, finite_nan_only=False)
        return StateMap.of([m / mags[-1] for m in mags])  # zero-free, as int4's
    raise PolicyError(f"state={fmt!r} is not a low-bit format; use one of {LOWBIT_FORMATS}")


def state_bytes(fmt: StateFormat, numel: int) -> int:
    """Bytes one quantized state tensor of ``numel`` elements takes: codes and absmaxes."""
    blocks = math.ceil(numel / fmt.block) if numel else 0
    codes = (numel + 1) // 2 if fmt.bits == 4 else numel
    return codes + 4 * blocks


def describe_lowbit(fmt: StateFormat) -> str:
    """One line saying how the state is kept, for reports."""
    maps = {
        INT8: "dynamic 8-bit map",
        INT4: "4-bit dynamic map, zero-free power-of-two map for the second moment",
        FP8: "e4m3 values, e5m2 for the second moment",
    }[fmt.name]
    keep = f"; float32 for {', '.join(fmt.keep)}" if fmt.keep else ""
    return (
        f"{fmt.name} between steps ({maps}, one float32 absmax per {fmt.block} elements; "
        f"tensors under {fmt.min_size} elements float32{keep}), float32 inside step()"
    )
