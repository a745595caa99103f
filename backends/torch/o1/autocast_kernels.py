"""O1's kernels: Python kernels at torch's Autocast dispatch keys, registered with
``torch.library`` for the operators a policy decides differently from ``torch.autocast``.

``torch.autocast`` decides each operator's dtype in C++, at the ``AutocastCPU`` /
``AutocastCUDA`` dispatch key, for the operators on its lists; every other operator falls
through that key. For the operators where a wrapped model's policy says something else
(``softmax`` and ``layer_norm`` in float32 on the CPU, an edited list, a module rule,
``"torch:"`` names), :func:`install` registers one :class:`Kernel` at that key. It asks
:func:`mixprec_torch.o1.regions.current` which region is in force and lets the region's
handler run the operator (cast, then run it with the Autocast key excluded, as torch's own
autocast kernels do). Outside every region it runs the operator exactly as torch would:
torch's own kernel at that key when there is one (``torch.library.get_kernel``), else on
to the keys beneath. So a region is carried by torch's own dispatch: into checkpoint
recomputations, ``torch.compile``'s tracing, user code torch calls back; a nested
``torch.autocast(enabled=False)`` turns the kernels off as it turns autocast off.

Regions that run without autocast but ban an op (O2/O3 under float16) get a kernel at the
device's Autograd key for the banned operators instead, which raises the policy's error
inside a region and otherwise calls torch's own kernel.

Kernels are registered once per process and stay: after the first ``wrap`` that needs them,
the operators they cover run through a Python kernel (about a microsecond) in every
``torch.autocast`` region of the process, with torch's own results. A kernel another library
(or the user's own ``torch.library`` code) registered at the same key for the same operator
is found before anything changes and refused by name (:func:`foreign`), never overridden.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

from ..torch_private import (
    dispatch_key,
    excluding,
    kernel_origin,
    keys_after,
    never_compiled,
    op_schema,
    registered_by_torch,
)
from .regions import current

__all__ = ["Claim", "Kernel", "foreign", "install", "installed"]

Kind = Literal["Autocast", "Autograd"]
Claim = tuple[str, str, Kind]
"""(qualified ATen overload ``"aten::softmax.int"``, device type, kind of key)."""

_HERE = (__file__, str(Path(__file__).resolve()))


class Claims(Protocol):
    """What :func:`install` reads of an op-casting plan
    (:class:`~mixprec_torch.o1.autocast.OpCasting` is one)."""

    def claims(self) -> Iterable[Claim]:
        """Every (operator, device type, key kind) the plan needs a kernel at."""
        ...


class Kernel:
    """The kernel of one ATen operator at one dispatch key.

    :param name: the qualified overload, ``"aten::softmax.int"``.
    :param device_type: ``"cpu"``, ``"cuda"``...
    :param kind: ``"Autocast"`` (casts by the region's handlers) or ``"Autograd"`` (bans).
    """

    def __init__(self, name: str, device_type: str, kind: Kind) -> None:
        self.name = name
        base, _, overload = name.removeprefix("aten::").partition(".")
        self.op: Any = getattr(getattr(torch.ops.aten, base), overload or "default")
        self.key = dispatch_key(kind, device_type)
        self.autocast = kind == "Autocast"
        # torch's own kernel here (autocast's cast, or the autograd kernel), else fall through
        own = kernel_origin(name, self.key) is not None or not self.autocast
        self.original = torch.library.get_kernel(name, self.key) if own else None
        self.after = keys_after(self.key)
        arguments = op_schema(self.op).arguments
        self.tensor_args = tuple(i for i, a in enumerate(arguments) if str(a.type) == "Tensor")
        """Positions of the ``Tensor`` arguments (a Python number may arrive there)."""
        self.slots: tuple[tuple[int, str, bool], ...] = tuple(
            (i, a.name, "List" in str(a.type))
            for i, a in enumerate(arguments)
            if str(a.type).replace("Optional[", "").replace("List[", "").startswith("Tensor")
        )
        """(position, name, a list of tensors) of every tensor argument, in schema order: what
        a handler reads and casts (a keyword-only one arrives by name)."""
        self.excluded = torch.DispatchKeySet(self.key)

    def __call__(self, keyset: Any, *args: Any, **kwargs: Any) -> Any:
        region = current()
        if region is not None:
            handler = (region.handlers if self.autocast else region.bans).get(self.name)
            if handler is not None:
                return handler.run(region, self, keyset, args, kwargs)
        return self.passthrough(keyset, args, kwargs)

    def passthrough(self, keyset: Any, args: Any, kwargs: Any) -> Any:
        """Run the operator as torch runs it at this key: torch's own kernel here, else on
        to the keys beneath."""
        for i in self.tensor_args:
            if i < len(args) and type(args[i]) in _NUMBERS:
                return self._with_numbers(keyset, args, kwargs)
        if self.original is not None:
            return self.original.call_boxed(keyset, *args, **kwargs)
        return self.op.redispatch(keyset & self.after, *args, **kwargs)

    def _with_numbers(self, keyset: Any, args: Any, kwargs: Any) -> Any:
        # A Python number passed for a Tensor argument (``x * 0.5`` reaches aten::mul.Tensor)
        # arrives here as the number, which only a plain call turns back into a tensor.
        # These are elementwise operators with nothing beneath them to cast, so skipping
        # this key for the call changes nothing but the route.
        if self.original is not None:
            tensors = [
                torch.tensor(a) if i in self.tensor_args and type(a) in _NUMBERS else a
                for i, a in enumerate(args)
            ]
            return self.original.call_boxed(keyset, *tensors, **kwargs)
        with excluding(self.key):
            return self.op(*args, **kwargs)

    def below(self) -> Any:
        """A context manager under which the operator runs without this key (the region's
        cast is final: nothing inside is cast again)."""
        return excluding(self.excluded)


never_compiled(Kernel.__call__)

_NUMBERS = (int, float, bool, complex)

_LIB = torch.library.Library("aten", "IMPL")
_installed: dict[tuple[str, str, Kind], Kernel] = {}


def installed(claim: Claim) -> Kernel | None:
    """The kernel mixprec registered for ``claim``, if any."""
    return _installed.get(claim)


def foreign(claims: Iterable[Claim]) -> list[str]:
    """One line per claim whose key holds a kernel neither torch nor mixprec registered
    (another library's, or the user's own ``torch.library`` code), or one that replaced
    mixprec's: ``"aten::softmax.int at AutocastCPU (registered at /path/lib.py:12)"``."""
    found = []
    for claim in claims:
        name, device_type, kind = claim
        key = dispatch_key(kind, device_type)
        origin = kernel_origin(name, key)
        if origin is None:
            continue
        ours = any(here in origin for here in _HERE)
        if ours or (claim not in _installed and registered_by_torch(origin)):
            continue
        found.append(f"{name} at {key.name} ({origin})")
    return found


def install(plan: Claims) -> None:
    """Register the kernels ``plan`` needs that are not registered yet (check
    :func:`foreign` first: a kernel registered here replaces what is there)."""
    for claim in plan.claims():
        if claim in _installed:
            continue
        name, device_type, kind = claim
        kernel = Kernel(name, device_type, kind)
        with warnings.catch_warnings():  # torch warns when a kernel replaces autocast's own
            warnings.simplefilter("ignore", UserWarning)
            _LIB.impl(name.removeprefix("aten::"), kernel, kernel.key.name, with_keyset=True)
        _installed[claim] = kernel
