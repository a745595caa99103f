"""FP8 as a policy item: the formats, the four scaling recipes, and their arithmetic.

A policy's ``fp8`` item (``"O1-bf16,fp8=tensorwise"``, the presets ``O1-fp8`` and ``O2-fp8``)
runs the ``linear`` family as an FP8 GEMM on top of a bfloat16 or float16 policy: forward
operands (the input and the weight) in ``float8_e4m3fn``, the gradient of the output in
``float8_e5m2`` in the two backward GEMMs (Transformer Engine's "hybrid" format); every other
op keeps the base policy's rules. Each operand is *scaled* into the format's range before it
is rounded: ``q = round(x * s)``, and the GEMM multiplies the ``q`` s and divides by the
scales. A recipe says where the scales come from.

``tensorwise``
    Current scaling, one scale per tensor per call: ``s = fmt_max / amax(|x|)``
    (``448 / amax`` for e4m3, ``57344 / amax`` for e5m2), computed in float32, not rounded
    to a power of two.
``rowwise``
    The same per row along the GEMM's reduction dimension: per token of the activation,
    per output row of the weight in the forward GEMM; in each backward GEMM every operand is
    scaled again along that GEMM's reduction dimension (the gradient of the output per token
    and per output feature, the weight per input column, the input per feature).
``delayed``
    One scale per tensor from the history of its amax
    (:class:`~mixprec.numerics.fp8.scaling.DelayedScaling`): ``s = fmt_max / max(history) /
    2**margin``, the history (default 16 steps, margin 0) updated after each step that is
    not skipped. Until a tensor has a history (the first
    step) it is scaled as ``tensorwise``.
``mxfp8``
    OCP Microscaling: blocks of 32 consecutive elements along the reduction dimension share
    one power-of-two scale ``X = 2**(floor(log2(amax_block)) - 8)`` stored as
    ``float8_e8m0fnu``, the elements are ``x / X`` in ``float8_e4m3fn``; the gradient of the
    output is in ``float8_e5m2`` with ``X = 2**(floor(log2(amax_block)) - 15)`` (15 is e5m2's
    largest exponent as 8 is e4m3's). A last block shorter than 32 keeps its own scale. The
    quantising multiplier is ``s = 1 / X``.

The arithmetic, which every backend follows bit for bit (the NumPy plugin is the readable
vectorised reference, :func:`round_to_format` and :func:`tensor_scale` the scalar one):

- an operand is first widened to float32 (exact from bfloat16 and float16);
- ``amax`` is the largest ``|x|`` of the tensor, row or block (float32, exact);
- a scale is ``1.0`` when ``amax`` is 0 or not finite, else ``fmt_max / amax`` rounded to
  float32, at most float32's largest value (a tiny ``amax`` would give inf);
- the scaled value ``y = x * s`` is rounded to float32, then to the format: round to
  nearest, ties to even, subnormals kept, finite values beyond ``fmt_max`` saturate to
  ``±fmt_max``; a non-finite ``x`` becomes NaN (so a bad batch stays visible to the step
  guard instead of hiding at ``fmt_max``);
- the dequantised operand is ``q * (1 / s)`` in float32, ``1 / s`` rounded to float32 (exact
  for mxfp8's powers of two), and the GEMM runs on the dequantised operands in float32
  (``torch._scaled_mm`` on the CPU computes exactly that), its result rounded to the
  policy's compute dtype. The bias is added in float32 before that rounding.

A non-finite amax never enters a scale or the delayed history.
"""

from __future__ import annotations

import math
import re
import reprlib
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from mixprec.dtypes import BFLOAT16, FLOAT8_E4M3FN, FLOAT8_E5M2, FLOAT16, format_info
from mixprec.errors import PolicyError

__all__ = [
    "BACKWARD_FORMAT",
    "FLOAT8_E8M0FNU",
    "FORWARD_FORMAT",
    "FP8_RECIPES",
    "MX_BLOCK",
    "ROLES",
    "ROLE_FORMATS",
    "FP8Recipe",
    "check_fp8",
    "describe_fp8",
    "fp8_recipe",
    "mx_exponent",
    "round_to_format",
    "tensor_scale",
    "to_float32",
]

RecipeName = Literal["tensorwise", "rowwise", "delayed", "mxfp8"]
#: The recipes the ``fp8`` policy item may name, in the order they are listed.
FP8_RECIPES: tuple[RecipeName, ...] = ("tensorwise", "rowwise", "delayed", "mxfp8")
#: The format of the forward GEMM's operands (the input and the weight).
FORWARD_FORMAT: Final = FLOAT8_E4M3FN
#: The format of the gradient of the output in the two backward GEMMs.
BACKWARD_FORMAT: Final = FLOAT8_E5M2
#: mxfp8's scale format: an unsigned power of two, 2**-127 .. 2**127 (0xFF is NaN).
FLOAT8_E8M0FNU: Final = "float8_e8m0fnu"
#: Elements per mxfp8 block along the reduction dimension.
MX_BLOCK: Final = 32
#: The three tensors of an FP8 linear, as the delayed history and the statistics name them.
ROLES: tuple[str, ...] = ("input", "weight", "grad_output")
#: The format each role is quantised to.
ROLE_FORMATS: Mapping[str, str] = {
    "input": FORWARD_FORMAT,
    "weight": FORWARD_FORMAT,
    "grad_output": BACKWARD_FORMAT,
}

_BASES = (BFLOAT16, FLOAT16)
_MAX_HISTORY = 1024
_MAX_MARGIN = 32
_MAX_TEXT = 200
_DESCRIPTIONS: Mapping[str, str] = {
    "tensorwise": "current per-tensor scaling",
    "rowwise": "current scaling per row along the reduction dimension",
    "delayed": "per-tensor scaling from an amax history",
    "mxfp8": f"OCP MX blocks of {MX_BLOCK} with power-of-two e8m0 scales",
}
_short = reprlib.Repr()
_short.maxstring, _short.maxother, _short.maxlevel = 60, 60, 2
_RECIPE_TEXT = re.compile(r"\s*([A-Za-z0-9_]+)\s*(?:\((.*)\))?\s*", re.DOTALL)
_FORMS = (
    f"one of {', '.join(FP8_RECIPES)}, 'none', or 'delayed(history=<1..{_MAX_HISTORY}>,"
    f"margin=<0..{_MAX_MARGIN}>)'"
)


@dataclass(frozen=True)
class FP8Recipe:
    """An FP8 scaling recipe: ``name`` (one of :data:`FP8_RECIPES`) and, for ``delayed``,
    the amax ``history`` length and the ``margin`` (the scale is divided by
    ``2**margin``). ``str(recipe)`` is its policy text (``"delayed(history=32)"``).

    :raises PolicyError: an unknown name, settings out of range, or settings on a recipe
        other than ``delayed``.
    """

    name: RecipeName
    history: int = 16
    margin: int = 0

    def __post_init__(self) -> None:
        if self.name not in FP8_RECIPES:
            raise PolicyError(f"unknown fp8 recipe {_short.repr(self.name)}; write {_FORMS}")
        history = _setting("history", self.history, 1, _MAX_HISTORY)
        margin = _setting("margin", self.margin, 0, _MAX_MARGIN)
        if self.name != "delayed" and (history, margin) != (16, 0):
            raise PolicyError(
                f"fp8={self.name} takes no settings (history and margin belong to "
                f"fp8=delayed); write fp8={self.name} or fp8=delayed(history={history})"
            )
        object.__setattr__(self, "history", history)
        object.__setattr__(self, "margin", margin)

    def __str__(self) -> str:
        changed = [
            f"{key}={value}"
            for key, value, default in (("history", self.history, 16), ("margin", self.margin, 0))
            if value != default
        ]
        return f"{self.name}({','.join(changed)})" if changed else self.name

    @property
    def scaling(self) -> Literal["tensor", "row", "block"]:
        """What shares one scale: the whole tensor, a row, or a block of :data:`MX_BLOCK`."""
        if self.name == "rowwise":
            return "row"
        return "block" if self.name == "mxfp8" else "tensor"

    def describe(self) -> str:
        """One line for reports: the recipe and what it scales by."""
        extra = f", history {self.history}, margin {self.margin}" if self.name == "delayed" else ""
        return f"{self.name} ({_DESCRIPTIONS[self.name]}{extra})"


def _setting(key: str, value: object, low: int, high: int) -> int:
    if isinstance(value, str) and re.fullmatch(r"\s*\d{1,6}\s*", value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise PolicyError(
            f"fp8 {key}={_short.repr(value)} must be an integer from {low} to {high}; "
            f"write {_FORMS}"
        )
    return value


def _parse(text: str) -> FP8Recipe | None:
    if len(text) > _MAX_TEXT:
        raise PolicyError(f"fp8={_short.repr(text)} is too long; write {_FORMS}")
    found = _RECIPE_TEXT.fullmatch(text)
    name = found[1].lower() if found else ""
    if name == "none" and found is not None and found[2] is None:
        return None
    if found is None or name not in FP8_RECIPES:
        close = [r for r in FP8_RECIPES if name and (r.startswith(name[:3]) or name in r)]
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise PolicyError(f"unknown fp8 recipe {_short.repr(text)}.{hint} Write {_FORMS}")
    settings: dict[str, object] = {}
    for item in (found[2] or "").split(","):
        if not item.strip():
            continue
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or key not in ("history", "margin") or key in settings:
            problem = "repeated" if key in settings else "unknown"
            raise PolicyError(
                f"{problem} fp8 setting {_short.repr(item.strip())} in fp8={_short.repr(text)}; "
                f"write {_FORMS}"
            )
        settings[key] = value
    return FP8Recipe(name, **settings)  # type: ignore[arg-type]


def fp8_recipe(value: object) -> FP8Recipe | None:
    """The recipe a policy's ``fp8`` item names: None (or ``"none"``) for no FP8, a recipe
    name, ``"delayed(history=32,margin=1)"``, or an :class:`FP8Recipe`.

    :raises PolicyError: anything else, naming the recipes.
    """
    if value is None or isinstance(value, FP8Recipe):
        return value
    if isinstance(value, str):
        return _parse(value)
    raise PolicyError(f"fp8 must be a string, got {_short.repr(value)}; write {_FORMS}")


def check_fp8(value: object, compute: str) -> FP8Recipe | None:
    """The policy's canonical ``fp8`` item, after checking that its base fits.

    :param compute: the policy's compute dtype (canonical, or ``"auto"``).
    :raises PolicyError: a bad recipe, or a compute dtype other than bfloat16 or float16.
    """
    recipe = fp8_recipe(value)
    if recipe is not None and compute not in _BASES:
        fix = (
            f"use preset 'O1-fp8' or 'O2-fp8' (bfloat16 base), or "
            f"'O1-bf16,fp8={recipe}' / 'O1,fp8={recipe}'"
        )
        raise PolicyError(
            f"fp8={recipe} runs FP8 GEMMs on top of a bfloat16 or float16 policy, but this "
            f"policy's compute dtype is {compute}: everything else would have no low-precision "
            f"dtype to run in. Recipes: {', '.join(FP8_RECIPES)}. Fix: {fix}"
        )
    return recipe


def describe_fp8(recipe: FP8Recipe, compute: str) -> str:
    """What ``fp8`` does to the ``linear`` family, for :meth:`mixprec.Policy.explain`."""
    return (
        "FP8: linear layers (nn.Linear) run this op as an FP8 GEMM,\n"
        f"  recipe {recipe.describe()};\n"
        f"  {FORWARD_FORMAT} input and weight, {BACKWARD_FORMAT} output gradients, output "
        f"in {compute}.\n"
        "  Layers a module rule decides, and functional linear calls outside such layers,\n"
        "  keep the dtype above."
    )


# ------------------------------------------------------------------------------------------
# The scalar reference arithmetic (plain Python floats)

_FLOAT32_MAX: Final = 3.4028234663852886e38


def to_float32(x: float) -> float:
    """``x`` rounded to the nearest float32 (ties to even; beyond float32's range: inf)."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]  # type: ignore[no-any-return]
    except OverflowError:
        return math.copysign(math.inf, x)


def round_to_format(x: float, fmt: str) -> float:
    """``x`` (a float32 value) rounded to the FP8 format ``fmt``: to nearest, ties to even,
    subnormals kept, finite values beyond the format's largest saturating to it, a
    non-finite ``x`` becoming NaN."""
    if not math.isfinite(x):
        return math.nan
    if x == 0.0:
        return x
    info = format_info(fmt)
    size = abs(x)
    if size >= info.smallest_normal:
        exponent = math.frexp(size)[1] - 1  # size = m * 2**exponent, 1 <= m < 2
        quantum = math.ldexp(1.0, exponent - info.mantissa_bits)
    else:
        quantum = info.smallest_subnormal
    rounded = round(size / quantum) * quantum  # division by a power of two: exact
    return math.copysign(min(rounded, info.max), x)


def tensor_scale(amax: float, fmt: str, margin: int = 0) -> float:
    """The float32 scale that maps ``amax`` onto the largest value of ``fmt``, divided by
    ``2**margin``; ``1.0`` when ``amax`` is 0 or not finite."""
    if not math.isfinite(amax) or amax == 0.0:
        return 1.0
    scale = min(to_float32(format_info(fmt).max / amax), _FLOAT32_MAX)
    return to_float32(math.ldexp(scale, -margin)) if margin else scale


def mx_exponent(amax: float, fmt: str = FORWARD_FORMAT) -> int:
    """The exponent ``e`` of an mxfp8 block's scale ``2**e``: ``floor(log2(amax))`` minus
    the element format's largest exponent (8 for e4m3: ``448 = 1.75 * 2**8``; 15 for e5m2),
    clamped to e8m0's range ``[-127, 127]``; 0 when ``amax`` is not finite, -127 when it is
    0."""
    if not math.isfinite(amax):
        return 0
    if amax == 0.0:
        return -127
    emax = math.frexp(format_info(fmt).max)[1] - 1
    return max(-127, min(127, math.frexp(amax)[1] - 1 - emax))
