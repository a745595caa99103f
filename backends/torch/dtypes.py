"""Canonical dtype names (mixprec's strings) to and from ``torch.dtype``.

The core speaks in strings (``"float32"``, ``"bfloat16"``); torch code needs
``torch.dtype`` objects. Both directions are table lookups, so the hot path (the op-casting
mode asks for the dtype of every floating input) stays cheap.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch

from mixprec.errors import UnsupportedDtypeError
from mixprec.kit import canonical_dtype

__all__ = [
    "FLOATING",
    "cast_floating",
    "dtype_name",
    "holds_wide_float",
    "is_floating",
    "refuse_complex",
    "torch_dtype",
]

_TO_TORCH: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    _dtype = getattr(torch, _name, None)
    if isinstance(_dtype, torch.dtype):
        _TO_TORCH[_name] = _dtype

_FROM_TORCH: dict[torch.dtype, str] = {dtype: name for name, dtype in _TO_TORCH.items()}

#: The torch floating dtypes mixprec reasons about (others, like complex, are left alone).
FLOATING: frozenset[torch.dtype] = frozenset(_FROM_TORCH)


def torch_dtype(name: str) -> torch.dtype:
    """The ``torch.dtype`` for a dtype name in any spelling mixprec accepts (``"bf16"``)."""
    canonical = canonical_dtype(name)
    try:
        return _TO_TORCH[canonical]
    except KeyError:
        raise UnsupportedDtypeError(
            f"torch {torch.__version__} has no dtype {canonical!r}; choose one of "
            f"{', '.join(sorted(_TO_TORCH))}"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of a floating ``torch.dtype`` (``torch.half`` -> ``"float16"``)."""
    try:
        return _FROM_TORCH[dtype]
    except KeyError:
        return canonical_dtype(str(dtype))


def refuse_complex(optimizers: Iterable[Any], names: dict[int, Any]) -> None:
    """Refuse complex parameters in the optimizers ``wrap`` takes, naming each and the fix.

    mixprec's step (the overflow check, the loss-scale unscaling, float32 masters, the
    compensated updates) is written for real floating dtypes; a complex parameter used to
    fail deep inside with "unknown dtype 'torch.complex64'", naming neither it nor a way on.

    :param names: ``id(param)`` -> its name, or ``(name, param)`` as ``wrap`` gathers them.
    :raises UnsupportedDtypeError: an optimizer holds a complex parameter.
    """
    found: dict[int, str] = {}
    for optimizer in optimizers:
        for group in getattr(optimizer, "param_groups", ()):
            for param in group.get("params", ()):
                if isinstance(param, torch.Tensor) and param.is_complex():
                    named = names.get(id(param), "an unnamed parameter")
                    name = named[0] if isinstance(named, tuple) else str(named)
                    found.setdefault(id(param), f"{name} ({param.dtype})")
    if not found:
        return
    shown = ", ".join(list(found.values())[:8])
    more = f" and {len(found) - 8} more" if len(found) > 8 else ""
    raise UnsupportedDtypeError(
        f"complex parameters cannot be stepped by mixprec: {shown}{more} "
        f"{'is' if len(found) == 1 else 'are'} in the optimizer given to wrap, and mixprec's "
        "step (overflow check, loss-scale unscaling, float32 masters) is for real floating "
        "dtypes. Step them with an optimizer of their own that wrap does not take (wrap the "
        "optimizer of the real parameters only) under a policy without loss scaling (O0, "
        "O1-bf16, O2-bf16, O3-bf16: under a loss-scaled one their gradients stay scaled), or "
        "keep each as a real tensor (torch.view_as_real) and take torch.view_as_complex of it "
        "in forward"
    )


def is_floating(dtype: torch.dtype) -> bool:
    """True for the floating dtypes mixprec casts (float64/32/16, bfloat16, float8)."""
    return dtype in _FROM_TORCH


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating tensor inside (tuples, lists, dicts) cast to ``dtype``.

    The one casting walk of the backend: model boundaries, islands and the op-casting mode
    all use it. Containers without a tensor inside are returned as they are.
    """
    if isinstance(value, torch.Tensor):
        if value.dtype in FLOATING and value.dtype != dtype:
            return value.to(dtype)
        return value
    if isinstance(value, tuple):
        items = [cast_floating(v, dtype) for v in value]
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [cast_floating(v, dtype) for v in value]
    if isinstance(value, dict):
        if type(value) is dict:
            return {k: cast_floating(v, dtype) for k, v in value.items()}
        out = copy.copy(value)  # OrderedDict, Hugging Face ModelOutput ...
        for k, v in value.items():
            out[k] = cast_floating(v, dtype)
        return out
    return value


_WIDE = (torch.float32, torch.float64)


def holds_wide_float(values: Any) -> bool:
    """Whether a float32 or float64 tensor is among ``values`` (or directly inside a list or
    tuple among them): the cheap look before a cast inside a low-precision forward."""
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.dtype in _WIDE:
                return True
        elif isinstance(value, (list, tuple)) and holds_wide_float(value):
            return True
    return False
