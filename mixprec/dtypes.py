"""Canonical dtype names, their aliases, and the facts about each floating-point format.

Dtypes are plain strings everywhere in mixprec: ``"float32"``, ``"float16"``, ``"bfloat16"``,
``"float8_e4m3fn"`` and ``"float8_e5m2"``. :func:`canonical_dtype` turns what users and
frameworks write (``"fp16"``, ``"half"``, ``"torch.bfloat16"``, ``numpy.dtype("float16")``)
into one of them. :func:`format_info` gives the numbers lint and diagnostics need.

``"float64"`` is known too, so that a double-precision *input* can be reasoned about
(:func:`widest`), but it is not a dtype a policy may ask for.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterable
from dataclasses import dataclass

from mixprec.errors import PolicyError

__all__ = [
    "BFLOAT16",
    "FLOAT8_E4M3FN",
    "FLOAT8_E5M2",
    "FLOAT16",
    "FLOAT32",
    "FLOAT64",
    "POLICY_DTYPES",
    "FormatInfo",
    "canonical_dtype",
    "format_info",
    "holds",
    "is_floating",
    "is_low_precision",
    "widest",
]

FLOAT32 = "float32"
FLOAT16 = "float16"
BFLOAT16 = "bfloat16"
FLOAT8_E4M3FN = "float8_e4m3fn"
FLOAT8_E5M2 = "float8_e5m2"
FLOAT64 = "float64"

#: The dtypes a policy role (param, compute, output, master, reduce) may name.
POLICY_DTYPES: tuple[str, ...] = (FLOAT32, FLOAT16, BFLOAT16, FLOAT8_E4M3FN, FLOAT8_E5M2)


@dataclass(frozen=True)
class FormatInfo:
    """Facts about one binary floating-point format.

    ``max`` is the largest finite value, ``smallest_normal`` the smallest positive normal
    value, ``smallest_subnormal`` the smallest positive value at all, and ``eps`` the gap
    between 1.0 and the next representable value (``2**-mantissa_bits``). ``mantissa_bits``
    counts the stored fraction bits, without the implicit leading one.
    """

    name: str
    bits: int
    exponent_bits: int
    mantissa_bits: int
    max: float
    smallest_normal: float
    smallest_subnormal: float
    eps: float


def _ieee(
    name: str, exponent_bits: int, mantissa_bits: int, *, finite_only: bool = False
) -> FormatInfo:
    # IEEE-754 layout: bias 2**(e-1)-1; the all-ones exponent encodes inf/NaN. The "fn"
    # float8 formats (finite, NaN only at all-ones) reuse that exponent for numbers and
    # give up only the all-ones mantissa, so their max is one exponent step higher.
    bias = 2 ** (exponent_bits - 1) - 1
    if finite_only:
        top = 2.0 ** (bias + 1) * (2.0 - 2.0 ** (1 - mantissa_bits))
    else:
        top = 2.0**bias * (2.0 - 2.0**-mantissa_bits)
    return FormatInfo(
        name=name,
        bits=1 + exponent_bits + mantissa_bits,
        exponent_bits=exponent_bits,
        mantissa_bits=mantissa_bits,
        max=top,
        smallest_normal=2.0 ** (1 - bias),
        smallest_subnormal=2.0 ** (1 - bias - mantissa_bits),
        eps=2.0**-mantissa_bits,
    )


_FORMATS: dict[str, FormatInfo] = {
    FLOAT64: _ieee(FLOAT64, 11, 52),
    FLOAT32: _ieee(FLOAT32, 8, 23),
    FLOAT16: _ieee(FLOAT16, 5, 10),
    BFLOAT16: _ieee(BFLOAT16, 8, 7),
    FLOAT8_E4M3FN: _ieee(FLOAT8_E4M3FN, 4, 3, finite_only=True),
    FLOAT8_E5M2: _ieee(FLOAT8_E5M2, 5, 2),
}

_ALIASES: dict[str, str] = {
    "fp64": FLOAT64,
    "f64": FLOAT64,
    "double": FLOAT64,
    "fp32": FLOAT32,
    "f32": FLOAT32,
    "float": FLOAT32,
    "single": FLOAT32,
    "fp16": FLOAT16,
    "f16": FLOAT16,
    "half": FLOAT16,
    "bf16": BFLOAT16,
    "fp8_e4m3fn": FLOAT8_E4M3FN,
    "f8e4m3fn": FLOAT8_E4M3FN,
    "fp8_e5m2": FLOAT8_E5M2,
    "f8e5m2": FLOAT8_E5M2,
}

# "torch.float16", "np.float16", "mx.float16", "<class 'numpy.float16'>" ...
_PREFIXES = ("torch.", "numpy.", "np.", "jax.numpy.", "jnp.", "mxnet.", "mx.", "ml_dtypes.")


@functools.lru_cache(maxsize=256)
def _canonical(text: str) -> str:
    key = text.strip().lower()
    if key.startswith("<class '") and key.endswith("'>"):
        key = key[8:-2]
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            key = key[len(prefix) :]
            break
    if key in _FORMATS:
        return key
    if key in _ALIASES:
        return _ALIASES[key]
    names = [*_FORMATS, *_ALIASES]
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise PolicyError(
        f"unknown dtype {text!r}.{hint} Valid dtypes: {', '.join(POLICY_DTYPES)} "
        f"(aliases: {', '.join(sorted(_ALIASES))})"
    )


def canonical_dtype(name: object) -> str:
    """The canonical name of a dtype: ``"fp16"``/``"half"``/``"f16"`` → ``"float16"``.

    Case-insensitive; framework prefixes (``"torch.float16"``) and dtype objects whose
    ``str()`` is such a name are accepted.

    :raises PolicyError: the name is unknown (the message lists the valid names and the
        closest matches).
    """
    return _canonical(name if isinstance(name, str) else str(name))


def format_info(dtype: object) -> FormatInfo:
    """The :class:`FormatInfo` of a dtype (any spelling :func:`canonical_dtype` accepts)."""
    return _FORMATS[canonical_dtype(dtype)]


def is_floating(dtype: str) -> bool:
    """True when ``dtype`` names a floating-point format mixprec knows (no error otherwise)."""
    try:
        canonical_dtype(dtype)
    except PolicyError:
        return False
    return True


def is_low_precision(dtype: object) -> bool:
    """True for float16, bfloat16 and the float8 formats (narrower than float32)."""
    return format_info(dtype).bits < 32


def _contains(wide: FormatInfo, narrow: FormatInfo) -> bool:
    # every value of `narrow` is exactly representable in `wide`
    return wide.exponent_bits >= narrow.exponent_bits and wide.mantissa_bits >= narrow.mantissa_bits


def holds(wide: object, narrow: object) -> bool:
    """True when every value of dtype ``narrow`` is exactly representable in ``wide``."""
    return _contains(format_info(wide), format_info(narrow))


# the formats promotion may land on, narrowest first
_PROMOTION_LADDER = (FLOAT8_E5M2, FLOAT16, BFLOAT16, FLOAT32, FLOAT64)


@functools.lru_cache(maxsize=512)
def _widest(dtypes: frozenset[str]) -> str:
    infos = [_FORMATS[d] for d in dtypes]
    for info in infos:
        if all(_contains(info, other) for other in infos):
            return info.name
    for name in _PROMOTION_LADDER:
        if all(_contains(_FORMATS[name], other) for other in infos):
            return name
    raise AssertionError("float64 contains every format")  # pragma: no cover


def widest(dtypes: Iterable[object]) -> str:
    """The narrowest format that holds every value of all ``dtypes`` (type promotion).

    ``widest(["float16", "float32"]) == "float32"`` and, because neither holds the other,
    ``widest(["float16", "bfloat16"]) == "float32"``.

    :raises PolicyError: ``dtypes`` is empty or names an unknown dtype.
    """
    names = frozenset(canonical_dtype(d) for d in dtypes)
    if not names:
        raise PolicyError("widest() needs at least one dtype")
    return _widest(names)
