"""apex's function registry on mixprec: ``register_*_function``, the ``*_function``
decorators and ``disable_casts``.

A function of a ``torch`` module becomes a policy op rule (``"torch:<module>.<name>"`` in the
``lowp``, ``fp32`` or ``promote`` list), so ``explain`` and the dtype report see it. A
function of any other module, and a function given to a decorator, is wrapped instead: inside
a wrapped model's forward its floating-point tensor arguments are cast to the compute dtype
(``half``), to float32 (``float``) or to the widest of them (``promote``), as apex does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Literal, TypeVar

import torch

from mixprec.errors import PolicyError
from mixprec.kit import Policy

from ..o1 import autocast as _autocast
from ..o1.regions import current, suspended

__all__ = [
    "apply_registered",
    "disable_casts",
    "float_function",
    "half_function",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
]

Kind = Literal["lowp", "fp32", "promote"]
F = TypeVar("F", bound=Callable[..., Any])

_REGISTERED: list[tuple[Kind, ModuleType, str]] = []
_LOWP: list[torch.dtype] = [torch.float16]  # the compute dtype of the latest initialize


def _in_region() -> bool:
    """Whether a wrapped model's forward is running (apex: "amp is active")."""
    return current() is not None


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _widest(values: Any) -> torch.dtype | None:
    found: list[torch.dtype] = []
    for value in values:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            found.append(value.dtype)
        elif isinstance(value, (list, tuple)):
            inner = _widest(value)
            if inner is not None:
                found.append(inner)
    if not found:
        return None
    return functools.reduce(torch.promote_types, found)


def _caster(kind: Kind, fn: F) -> F:
    @functools.wraps(fn)
    def cast_call(*args: Any, **kwargs: Any) -> Any:
        if not _in_region():
            return fn(*args, **kwargs)
        if kind == "promote":
            dtype = _widest([*args, *kwargs.values()])
            if dtype is None:
                return fn(*args, **kwargs)
        else:
            dtype = _LOWP[0] if kind == "lowp" else torch.float32
        with _autocast.autocast_off(("cpu", "cuda")):  # the cast decides, not autocast
            return fn(*_cast(args, dtype), **{k: _cast(v, dtype) for k, v in kwargs.items()})

    return cast_call  # type: ignore[return-value]


def half_function(fn: F) -> F:
    """Decorator: inside a wrapped forward, ``fn`` runs on the compute dtype (apex's half)."""
    return _caster("lowp", fn)


def float_function(fn: F) -> F:
    """Decorator: inside a wrapped forward, ``fn`` runs on float32 inputs."""
    return _caster("fp32", fn)


def promote_function(fn: F) -> F:
    """Decorator: inside a wrapped forward, ``fn``'s inputs are cast to the widest of them."""
    return _caster("promote", fn)


def _register(kind: Kind, module: ModuleType, name: str) -> None:
    if not callable(getattr(module, name, None)):
        raise PolicyError(
            f"register_*_function: {getattr(module, '__name__', module)!r} has no function "
            f"{name!r}; pass the module object and the name of a function in it, such as "
            "amp.register_float_function(torch.nn.functional, 'gelu')"
        )
    _REGISTERED.append((kind, module, name))


def register_half_function(module: ModuleType, function_name: str) -> None:
    """Run ``module.function_name`` in the compute dtype (call before ``initialize``)."""
    _register("lowp", module, function_name)


def register_float_function(module: ModuleType, function_name: str) -> None:
    """Run ``module.function_name`` in float32 (call before ``initialize``)."""
    _register("fp32", module, function_name)


def register_promote_function(module: ModuleType, function_name: str) -> None:
    """Run ``module.function_name`` on its widest input dtype (call before ``initialize``)."""
    _register("promote", module, function_name)


def apply_registered(policy: Policy, compute: torch.dtype) -> Policy:
    """``policy`` with the registered torch functions as op rules; other modules' functions
    are wrapped in place (once). ``compute`` is what ``half`` means from now on."""
    _LOWP[0] = compute
    lists: dict[Kind, list[str]] = {"lowp": [], "fp32": [], "promote": []}
    for kind, module, name in _REGISTERED:
        qualified = getattr(module, "__name__", "")
        if qualified == "torch" or qualified.startswith("torch."):
            lists[kind].append(f"torch:{qualified}.{name}")
        elif not getattr(getattr(module, name), "_mixprec_apex_cast", False):
            wrapped = _caster(kind, getattr(module, name))
            wrapped._mixprec_apex_cast = True  # type: ignore[attr-defined]
            setattr(module, name, wrapped)
    if any(lists.values()):
        policy = policy.with_ops(**lists)
    return policy


@contextmanager
def disable_casts() -> Iterator[None]:
    """Inside a wrapped forward: run the block in the tensors' own dtypes, no casting."""
    with suspended(), _autocast.autocast_off(("cpu", "cuda")):
        yield
