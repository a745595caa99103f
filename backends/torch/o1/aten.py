"""Op names to the ATen operator overloads O1's kernels sit on, in this torch build.

A neutral family maps to the overloads :data:`mixprec_torch.ops.ATEN_OPS` lists (those this
torch has). A policy may also name ``"torch:<name>"``: ``"torch:aten::addmm"`` (every overload
of ``aten::addmm`` that takes a tensor and writes none of its arguments),
``"torch:aten::addmm.dtype"`` (one overload), ``"torch:prelu"``, or a dotted path such as
``"torch:torch.linalg.svd"`` or ``"torch:nn.functional.prelu"`` (the ATen operator of that
name: ``aten::linalg_svd``, ``aten::prelu``). A Python-only function
(``"torch:nn.functional.normalize"``) has no operator of its own and is refused: name the
operators it calls.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from mixprec.errors import PolicyError

from ..ops import ATEN_OPS
from ..torch_private import op_schema

__all__ = ["aten_ops"]


def _qualified(name: str) -> str:
    """``"softmax.int"`` -> ``"aten::softmax.int"``; ``"exp"`` -> ``"aten::exp"``."""
    return f"aten::{name}"


def _packet(name: str) -> Any:
    return getattr(torch.ops.aten, name, None)


def _overloads(name: str) -> tuple[str, ...]:
    """The overloads of ``aten::<name>`` O1 may decide: those that take a tensor and write
    none of their arguments (no ``out=`` or in-place forms, which keep their dtype)."""
    packet = _packet(name)
    if packet is None:
        return ()
    found = []
    for overload in packet.overloads():
        schema = op_schema(getattr(packet, overload))
        takes_tensor = any("Tensor" in str(arg.type) for arg in schema.arguments)
        if takes_tensor and not schema.is_mutable:
            found.append(name if overload == "default" else f"{name}.{overload}")
    return tuple(found)


def _native_name(native: str) -> str:
    """The ATen name a ``"torch:"`` name points at (before any overload)."""
    if native.startswith("aten::"):
        return native[len("aten::") :]
    parts = native.split(".")
    if parts[0] == "torch":
        parts = parts[1:]
    if parts[:2] == ["nn", "functional"]:
        parts = parts[2:]
    elif parts[:1] == ["Tensor"]:
        parts = parts[1:]
    elif parts[:1] in (["linalg"], ["special"], ["fft"]) and len(parts) == 2:
        parts = [f"{parts[0]}_{parts[1]}"]
    return ".".join(parts)


@functools.cache
def aten_ops(op: str) -> tuple[str, ...]:
    """The qualified ATen overloads (``"aten::softmax.int"``) of a neutral family or a
    ``"torch:"`` name; other backends' native names map to nothing here.

    :raises PolicyError: a ``"torch:"`` name that names no ATen operator of this torch build.
    """
    if op in ATEN_OPS:
        return tuple(_qualified(n) for n in ATEN_OPS[op] if _exists(n))
    if not op.startswith("torch:"):
        return ()
    native = op.split(":", 1)[1]
    name = _native_name(native)
    found: tuple[str, ...] = ()
    if native.startswith("aten::") and "." in name:
        base, _, overload = name.partition(".")
        if _packet(base) is not None and overload in _packet(base).overloads():
            found = (name,)
    elif "." not in name:
        found = _overloads(name)
    if not found:
        raise PolicyError(
            f"op {op!r}: torch {torch.__version__} has no ATen operator named {name!r}; name "
            "a neutral family or an ATen operator (or its torch function), such as "
            "'torch:aten::addmm', 'torch:prelu' or 'torch:torch.linalg.svd'. A Python-only "
            "function (torch.nn.functional.normalize) has no operator of its own: name the "
            "operators it calls"
        )
    return tuple(_qualified(n) for n in found)


def _exists(name: str) -> bool:
    base, _, overload = name.partition(".")
    packet = _packet(base)
    return packet is not None and (overload or "default") in packet.overloads()
