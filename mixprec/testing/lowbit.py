"""Low-bit optimizer state in the conformance suite: the pure-Python reference codec and its
cases.

A backend that lists a low-bit format (``"int8"``, ``"int4"``, ``"fp8"``) in its adapter's
``state_dtypes`` implements the adapter method ``lowbit_quantize``
(:class:`~mixprec.testing.protocol.ConformanceAdapter`), and the suite compares what it
returns, bit for bit, with :func:`reference_lowbit`, which follows
:mod:`mixprec.numerics.lowbit`'s scheme in plain Python floats; it also trains the policies
of :data:`~mixprec.testing.cases.LOWBIT_POLICIES` through the trainer tests (a skipped step
leaves the codes and absmax bit for bit, a checkpoint resumes bit for bit).

Plain Python floats are doubles, and the reference rounds to float32 after each operation.
That is exact: the product of two float32 values fits a double, and a quotient correctly
rounded to a double and then to float32 is the float32 quotient correctly rounded (53 bits
hold more than twice 24 plus two).
"""

from __future__ import annotations

import bisect
import random
from typing import Protocol

from mixprec.numerics.lowbit import LOWBIT_FORMATS, parse_state_format, state_map
from mixprec.testing.cases import BackendUnderTest, Case
from mixprec.testing.floats import round_to

__all__ = [
    "LOWBIT_DATA",
    "LowBitQuantiser",
    "lowbit_codec_cases",
    "lowbit_data",
    "reference_lowbit",
]

Codec = tuple[list[int], list[float], list[float]]
"""The codes (bytes as stored: two 4-bit codes a byte, the even element in the low nibble),
the absmax of each block and the decoded values."""


class LowBitQuantiser(Protocol):
    """The adapter method a backend with low-bit state implements
    (:class:`~mixprec.testing.protocol.ConformanceAdapter`, ``lowbit_quantize``)."""

    def lowbit_quantize(self, state: str, signed: bool, values: list[float]) -> Codec: ...


def _f32(x: float) -> float:
    return round_to("float32", x)


def reference_lowbit(state: str, signed: bool, values: list[float]) -> Codec:
    """``values`` (float32 values, no inf or NaN) encoded under ``state`` (``"int8"``,
    ``"int4(block=32)"``) with the signed map or the unsigned one, and decoded again."""
    fmt = parse_state_format(state)
    if fmt is None:
        raise ValueError(f"{state!r} names no low-bit format; one of {LOWBIT_FORMATS}")
    smap = state_map(fmt.name, signed)
    codes: list[int] = []
    absmax: list[float] = []
    decoded: list[float] = []
    for start in range(0, len(values), fmt.block):
        block = [_f32(v) for v in values[start : start + fmt.block]]
        a = max(abs(v) for v in block)
        absmax.append(a)
        for v in block:
            code = bisect.bisect_left(smap.mids, _f32(v / a) if a > 0 else 0.0)
            codes.append(code)
            decoded.append(_f32(smap.values[code] * a))
    if fmt.bits == 4:
        codes += [0] * (len(codes) % 2)
        codes = [lo | hi << 4 for lo, hi in zip(codes[0::2], codes[1::2], strict=True)]
    return codes, absmax, decoded


def _common() -> dict[str, list[float]]:
    rng = random.Random(35)
    gauss = [rng.gauss(0.0, 1e-3) for _ in range(77)]  # 2 blocks of 32 and a short one
    zeros = [0.0] * 32 + [-0.0] * 7 + [0.0, 2.5e-4, -0.0, -1e-4]  # an all-zero block
    moment = [rng.gauss(0.0, 1.0) ** 2 * 10.0 ** -rng.randrange(12) for _ in range(70)]
    tiny = [1e-40, -1e-42, 5e-45, -3e-39, 0.0, 1.1e-38, 2.0**-126, -(2.0**-149)] * 4
    tiny += [2.0**-126, 1e-39, -1e-41, 3e-40] * 8  # a normal absmax over subnormals
    large = [3.4e38, -3e38, 1e38, 1.0, -1e-30, 7e37, 2.0**127, -(2.0**100)] * 5
    return {"gauss": gauss, "zeros": zeros, "moment": moment, "subnormal": tiny, "large": large}


_COMMON = _common()


def lowbit_data(name: str, state: str, signed: bool) -> list[float]:
    """Data set ``name`` (of :data:`LOWBIT_DATA`), as float32 values. ``"ties"`` depends on
    the map: every midpoint itself in blocks whose absmax is a power of two, so ``x / a``
    lands exactly on a midpoint (a tie: the lower code), and scaled by 3 (near ties)."""
    if name != "ties":
        return [_f32(v) for v in _COMMON[name]]
    fmt = parse_state_format(state)
    assert fmt is not None
    mids = list(state_map(fmt.name, signed).mids)
    out: list[float] = []
    for scale in (1.0, 2.0**-20, 2.0**40, 3.0):
        for start in range(0, len(mids), fmt.block - 1):
            out += [scale] + [_f32(m * scale) for m in mids[start : start + fmt.block - 1]]
            out += [0.0] * (-len(out) % fmt.block)  # the next chunk starts a block
    return out


#: The data sets every declared format is checked on (:func:`lowbit_data`).
LOWBIT_DATA: tuple[str, ...] = (*_COMMON, "ties")
#: The data sets also run under each format's default block (the others are shorter than
#: one such block, so they would repeat the short-block case).
_DEFAULT_BLOCK_DATA = ("gauss", "ties")


def lowbit_codec_cases(backend: BackendUnderTest) -> list[Case]:
    """(state, signed, data) for every low-bit format the adapter lists in ``state_dtypes``:
    blocks of 32 (short last blocks) on every data set, the format's default block on
    :data:`_DEFAULT_BLOCK_DATA`."""
    out: list[Case] = []
    for name in LOWBIT_FORMATS:
        if name not in backend.state_dtypes:
            continue
        for state, sets in ((f"{name}(block=32)", LOWBIT_DATA), (name, _DEFAULT_BLOCK_DATA)):
            for signed in (True, False):
                for data in sets:
                    sign = "signed" if signed else "unsigned"
                    out.append((f"{state}-{sign}-{data}", (state, signed, data)))
    return out
