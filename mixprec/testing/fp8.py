"""FP8 in the conformance suite: the pure-Python reference of each recipe, and its cases.

A backend whose device lists FP8 recipes (``DeviceCapability.fp8_recipes``) implements the
adapter method ``fp8_quantise`` (:class:`~mixprec.testing.protocol.ConformanceAdapter`) and
the suite compares what it returns, bit for bit, with :func:`reference_quantise`, which
follows :mod:`mixprec.numerics.fp8.recipes` in plain Python floats, and trains the FP8 policies of
:data:`~mixprec.testing.cases.FP8_POLICIES` through the trainer tests (a skipped step
changes nothing, a checkpoint resumes bit for bit, the delayed amax history included).
"""

from __future__ import annotations

import math
import random
from typing import Protocol

from mixprec.numerics.fp8.recipes import (
    BACKWARD_FORMAT,
    FORWARD_FORMAT,
    FP8_RECIPES,
    MX_BLOCK,
    mx_exponent,
    round_to_format,
    tensor_scale,
    to_float32,
)
from mixprec.testing.cases import FP8_POLICIES, BackendUnderTest, Case

__all__ = [
    "FP8_DATA",
    "FP8Quantiser",
    "fp8_operand_cases",
    "fp8_recipes",
    "fp8_refused_cases",
    "reference_quantise",
]

Rows = list[list[float]]


class FP8Quantiser(Protocol):
    """The adapter method a backend with FP8 recipes implements
    (:class:`~mixprec.testing.protocol.ConformanceAdapter`, ``fp8_quantise``)."""

    def fp8_quantise(
        self, recipe: str, fmt: str, rows: Rows, scale: float | None
    ) -> tuple[Rows, list[float]]: ...


def _amax(values: list[float]) -> float:
    # NaN wins, as in the frameworks' reductions (Python's max() depends on the order)
    if any(math.isnan(v) for v in values):
        return math.nan
    return max((abs(v) for v in values), default=0.0)


def _rounded(values: list[float], scale: float, fmt: str) -> list[float]:
    # x * s: two float32 factors, their exact product fits a double, so one rounding
    return [round_to_format(to_float32(v * scale), fmt) for v in values]


def reference_quantise(
    rows: Rows, recipe: str, fmt: str, scale: float | None = None
) -> tuple[Rows, list[float]]:
    """``rows`` (float32 values) quantised to ``fmt`` along the last axis under ``recipe``.

    :param scale: the ``delayed`` recipe's scale from its history (None: none yet, so the
        tensor's own amax scales it, as ``tensorwise`` does); ignored by the others.
    :returns: the format values, and the scales ``s`` they were multiplied by, row-major:
        one for the tensor, one per row (``rowwise``), or one per block of
        :data:`~mixprec.numerics.fp8.recipes.MX_BLOCK` per row (``mxfp8``).
    """
    rows = [[to_float32(v) for v in row] for row in rows]
    if recipe in ("tensorwise", "delayed"):
        if scale is None or recipe == "tensorwise":
            scale = tensor_scale(_amax([v for row in rows for v in row]), fmt)
        return [_rounded(row, scale, fmt) for row in rows], [scale]
    if recipe == "rowwise":
        scales = [tensor_scale(_amax(row), fmt) for row in rows]
        return [_rounded(row, s, fmt) for row, s in zip(rows, scales, strict=True)], scales
    if recipe != "mxfp8":
        raise ValueError(f"unknown recipe {recipe!r}; one of {FP8_RECIPES}")
    out: Rows = []
    scales = []
    for row in rows:
        quantised: list[float] = []
        for start in range(0, len(row), MX_BLOCK):
            block = row[start : start + MX_BLOCK]
            s = math.ldexp(1.0, -mx_exponent(_amax(block), fmt))
            scales.append(s)
            quantised += _rounded(block, s, fmt)
        out.append(quantised)
    return out, scales


def _data() -> dict[str, Rows]:
    rng = random.Random(8)

    def gauss(rows: int, cols: int, size: float) -> Rows:
        return [[rng.gauss(0.0, size) for _ in range(cols)] for _ in range(rows)]

    outlier = gauss(6, 40, 1.0)
    outlier[2] = [v * 1e4 for v in outlier[2]]  # an outlier row
    outlier[4][33] = 3e6  # and an outlier element in the last, short block
    tiny = gauss(4, 40, 1e-5)
    tiny[1] = [0.0] * 40  # an all-zero row: scale 1.0
    tiny[3][:8] = [1e-40, -1e-42, 0.0, -0.0, 2.0**-126, 1e-38, 5e-45, -3e-39]  # subnormal
    bad = gauss(4, 40, 2.0)
    bad[1][5] = math.inf  # a non-finite row: NaN where not finite, scale 1.0
    bad[1][36] = math.nan
    return {"normal": gauss(6, 40, 3.0), "outlier": outlier, "tiny": tiny, "nonfinite": bad}


#: Small operands every recipe is checked on: 40 columns, so mxfp8 has a short last block.
FP8_DATA: dict[str, Rows] = _data()


def fp8_recipes(backend: BackendUnderTest) -> tuple[str, ...]:
    """The FP8 recipes the backend's device lists."""
    return tuple(getattr(backend.device_capability, "fp8_recipes", ()))


def fp8_operand_cases(backend: BackendUnderTest) -> list[Case]:
    """(recipe, format, data, delayed scale) for every recipe the device lists."""
    out: list[Case] = []
    for recipe in fp8_recipes(backend):
        for fmt in (FORWARD_FORMAT, BACKWARD_FORMAT):
            for data in FP8_DATA:
                scales: tuple[float | None, ...] = (None, 2.5) if recipe == "delayed" else (None,)
                for scale in scales:
                    tail = "" if scale is None else f"-scale{scale}"
                    case_id = f"{recipe}-{fmt}-{data}{tail}"
                    out.append((case_id, (recipe, fmt, data, scale)))
    return out


def fp8_refused_cases(backend: BackendUnderTest) -> list[Case]:
    """The FP8 policy of each recipe the device does not list: the backend must refuse it."""
    return [
        (name, (name,))
        for recipe, name in FP8_POLICIES.items()
        if recipe not in fp8_recipes(backend) and backend.runs(name)
    ]
