"""A wrapped model's boundary: the root's ``forward`` attribute, and its entries.

The root gets a :class:`ModuleForward` as its ``forward`` attribute, around its own forward:
the model's *boundary*. The policy's op-casting region opens (autocast;
:mod:`mixprec_torch.o1.regions`), floating inputs are cast to the root's dtype where that is low
precision (O2/O3), floating outputs to ``policy.output``. A forward rather than hooks: under
``torch.compile`` a user-defined module's hooks compile as frames (and graphs) of their own
beside its forward, each a call per step, and the boundary is part of the one frame; and the
root's call takes PyTorch's fast path. Hooks the user registers on the root run outside the
boundary (a pre-hook sees the inputs before they are cast, a post-hook the output after).

*Entries* are the modules users plausibly call on their own (the root's children, and every
module that holds others: ``model.encoder``, ``self.net``). Called from outside the model's
forward (``model.encoder(x)``, ``self.net(x)`` in a LightningModule's ``training_step``), an
entry opens the same boundary around itself as the root would (its nearest ruled ancestor's
module context, autocast off under a pinned ancestor, inputs cast to its own dtype). Inside
the model's forward, and during a checkpoint's recomputation in backward (which runs in the
forward's regions already, without boundary casts), it only reads a counter
(:attr:`Owner.depth`). An entry is a :class:`ModuleForward` too (a module without hooks takes
PyTorch's fast call path: measured on this CPU, 2.5 µs a call without hooks, 8.3 µs with
two, on every call of every block), except on a module that also has island or context hooks
of its own (:mod:`mixprec_torch.wrapping.casting`): there it is a pair of :class:`EntryHooks`, which
wrap those hooks.

While ``torch.compile`` traces, a :class:`ModuleForward` does the same steps as ``with
torch.autocast(...)`` blocks (:func:`~mixprec_torch.o1.tracing.autocast_each`) and the
``mixprec::enter_region``/``exit_region`` operators, which dynamo keeps in the graph (an
entry compiled on its own opens its boundary that way too, without a graph break).
``inspect.signature(module.forward)`` still shows the module's own forward.

:data:`hooks_local` is this thread's stack of what each running hooked module opened, which
its post-hook closes (:func:`undo`); the island and context hooks use it too.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch
from torch import nn

from ..copies import CopyOnly
from ..dtypes import cast_floating, holds_wide_float
from ..o1.regions import Region, anchor, pop, push
from ..o1.tracing import autocast_each, disable_autocast
from ..torch_private import in_backward

__all__ = [
    "EntryHooks",
    "ModuleForward",
    "Owner",
    "hooks_local",
    "made_inside",
    "open_region",
    "undo",
]

_OFF = object()
"""Autocast state for a traced part: turned off inside."""


class Owner(Protocol):
    """What a :class:`ModuleForward` reads of its model's casting plan
    (:class:`~mixprec_torch.wrapping.casting.ModelCasting` is one)."""

    depth: int
    output_dtype: torch.dtype

    @property
    def casting(self) -> Any: ...
    @property
    def intercepts(self) -> bool: ...
    def check_params(self) -> None:
        """Raise if the model's parameters were cast after ``wrap``."""
        ...

    def leave(self) -> None: ...


class _HooksLocal(threading.local):
    def __init__(self) -> None:
        # (module, undo steps) per running forward with hooks, innermost last
        self.stack: list[tuple[nn.Module, list[Any]]] = []


hooks_local = _HooksLocal()


def undo(module: nn.Module) -> None:
    """Run the undo steps the pre-hook of ``module`` pushed (nothing if it pushed none)."""
    stack = hooks_local.stack
    if stack and stack[-1][0] is module:
        for step in reversed(stack.pop()[1]):
            step()


def open_region(region: Region) -> Any:
    """Open ``region`` (eagerly on this thread, or as the graph's operator while compiling);
    return what closes it."""
    if torch.compiler.is_compiling():
        torch.ops.mixprec.enter_region(region.id)
        return lambda: torch.ops.mixprec.exit_region(region.id)
    push(region)
    return pop


def _open_boundary(owner: Owner, region: Region | None, off: bool) -> list[Any]:
    """Eagerly: the model's region (autocast, kernels), a module context, autocast off under
    a pinned ancestor, and the depth count; returns the undo steps (run them on an error)."""
    undo: list[Any] = []
    try:
        casting = owner.casting
        if casting is not None:
            contexts = casting.enter()
            undo.append(lambda: casting.exit(contexts))
            if region is not None:
                push(region)
                undo.append(pop)
            if off:
                undo.append(disable_autocast(casting.device_types))
        owner.depth += 1
        undo.append(owner.leave)
    except BaseException:
        for step in reversed(undo):
            step()
        raise
    return undo


def made_inside(dtype: torch.dtype | None, args: Any, kwargs: dict[str, Any]) -> Any:
    """An entry inside the model's forward (or its recomputation in backward): a float32 or
    float64 tensor the model made itself (a positional encoding cached in ``forward``, a float
    mask) reaching a module whose parameters are low precision (``dtype``) is cast to their
    dtype, as the root's boundary casts the inputs; it would otherwise meet those parameters
    in the first matmul ("expected m1 and m2 to have the same dtype"). Only the top level is
    looked at; nothing is cast when no input is float32 or float64. Returns ``(args,
    kwargs)``, or None when nothing changes."""
    if dtype is None or not (holds_wide_float(args) or holds_wide_float(kwargs.values())):
        return None
    return cast_floating(args, dtype), cast_floating(kwargs, dtype)


def _close_boundary(owner: Owner, output: Any) -> Any:
    if output is None:
        return None
    if owner.intercepts:
        anchor(output)  # a recomputation in backward finds the forward's regions
    return cast_floating(output, owner.output_dtype)


class ModuleForward(CopyOnly):
    """The root's (or an entry's) ``forward`` attribute (see the module docstring).

    :param owner: the model's casting plan.
    :param forward: the module's own ``forward`` (bound).
    :param root: the model's root (its boundary always opens).
    :param entry: an entry point (its boundary opens when called from outside the forward).
    :param entry_input: the dtype the boundary casts inputs to (None: none).
    :param entry_region: the module context the boundary opens (nearest ruled ancestor).
    :param entry_off: autocast is off where the module sits (a pinned ancestor).
    :param island: autocast off inside (a root pinned to a dtype).
    :param region: the root's own context region (a root with rules of its own).
    """

    def __init__(
        self,
        owner: Owner,
        forward: Any,
        *,
        root: bool = False,
        entry: bool = False,
        entry_input: torch.dtype | None = None,
        entry_region: Region | None = None,
        entry_off: bool = False,
        island: bool = False,
        region: Region | None = None,
    ) -> None:
        self.owner = owner
        self.forward = forward
        self.__wrapped__ = forward  # inspect.signature(module.forward) sees the real one
        self.root = root
        self.entry = entry or root
        self.entry_input = entry_input
        self.entry_region = entry_region
        self.entry_off = entry_off
        self.island = island
        self.region = region
        self.site = island or region is not None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return self._traced(args, kwargs)
        if self.root or (self.entry and not self.owner.depth and not in_backward()):
            return self._boundary(args, kwargs)
        if self.entry_input is not None and (cast := made_inside(self.entry_input, args, kwargs)):
            args, kwargs = cast
        if self.site:
            return self._site(args, kwargs)
        return self.forward(*args, **kwargs)

    # ------------------------------------------------------------------ eagerly

    def _site(self, args: Any, kwargs: Any) -> Any:
        undo: list[Any] = []
        try:
            if self.region is not None:
                push(self.region)
                undo.append(pop)
            casting = self.owner.casting
            if self.island and casting is not None and casting.autocast is not None:
                undo.append(disable_autocast(casting.device_types))
            return self.forward(*args, **kwargs)
        finally:
            for step in reversed(undo):
                step()

    def _boundary(self, args: Any, kwargs: Any) -> Any:
        owner = self.owner
        if self.root:
            owner.check_params()
        undo = _open_boundary(owner, self.entry_region, self.entry_off)
        try:
            dtype = self.entry_input
            if dtype is not None:
                args, kwargs = cast_floating(args, dtype), cast_floating(kwargs, dtype)
            output = self._site(args, kwargs) if self.site else self.forward(*args, **kwargs)
        finally:
            for step in reversed(undo):
                step()
        return _close_boundary(owner, output)

    # ------------------------------------------------------------------ compiling

    def _traced(self, args: Any, kwargs: Any) -> Any:
        """The same steps in the form dynamo traces: autocast as ``with`` blocks, regions as
        the graph's operators."""
        owner = self.owner
        casting = owner.casting
        entering = self.root or (self.entry and not owner.depth)
        regions: list[Region] = []
        autocast: Any = None  # None: as around it; _OFF: off; a dtype: on
        if entering:
            if self.root:
                owner.check_params()
            if casting is not None:
                if owner.intercepts:
                    regions.append(casting.regions[None])
                if self.entry_region is not None:
                    regions.append(self.entry_region)
                if casting.autocast is not None:
                    autocast = _OFF if self.entry_off else casting.autocast
        if self.region is not None:
            regions.append(self.region)
        if self.island and casting is not None and casting.autocast is not None:
            autocast = _OFF
        for region in regions:
            torch.ops.mixprec.enter_region(region.id)
        if entering:
            owner.depth += 1
        try:
            if entering and self.entry_input is not None:
                args = cast_floating(args, self.entry_input)
                kwargs = cast_floating(kwargs, self.entry_input)
            elif self.entry and (cast := made_inside(self.entry_input, args, kwargs)):
                args, kwargs = cast
            if autocast is None:
                output = self.forward(*args, **kwargs)
            else:
                dtype = None if autocast is _OFF else autocast
                output = autocast_each(casting.device_types, dtype, self.forward, *args, **kwargs)
        finally:
            if entering:
                owner.depth -= 1
            for region in reversed(regions):
                torch.ops.mixprec.exit_region(region.id)
        if output is None or not entering:
            return output
        return cast_floating(output, owner.output_dtype)


class EntryHooks:
    """An entry as forward pre/post hooks, for a module that also has island or context
    hooks of its own (registered after them, pre-hook prepended: they run inside). Compiled
    on its own (``torch.compile(model.bn)``), it opens its boundary eagerly: one graph break
    each side."""

    def __init__(
        self, owner: Owner, input: torch.dtype | None, region: Region | None, off: bool
    ) -> None:
        self.owner = owner
        self.input = input
        self.region = region
        self.off = off

    def pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.owner.depth:  # inside the model's forward: the root's boundary holds already,
            return made_inside(self.input, args, kwargs)  # a tensor made inside it may not
        if torch.compiler.is_compiling():
            return _entry_pre_eagerly(self, module, args, kwargs)
        return self._pre(module, args, kwargs)

    def _pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if in_backward():  # a checkpoint's recomputation: inside the forward's regions already
            return made_inside(self.input, args, kwargs)  # cast as inside the forward
        hooks_local.stack.append((module, _open_boundary(self.owner, self.region, self.off)))
        if self.input is not None:
            return cast_floating(args, self.input), cast_floating(kwargs, self.input)
        return None

    def post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        stack = hooks_local.stack
        if not (stack and stack[-1][0] is module and self.owner.depth):
            return None  # the pre-hook entered nothing (the site's own hooks popped theirs)
        if torch.compiler.is_compiling():
            return _entry_post_eagerly(self, module, args, output)
        return self._post(module, args, output)

    def _post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        undo(module)
        return _close_boundary(self.owner, output)


_EAGER_ENTRY = (
    "mixprec: a module of a wrapped model with island or context hooks, compiled on its own, "
    "opens its boundary eagerly; compile the wrapped model itself for no graph break"
)
_entry_pre_eagerly = torch.compiler.disable(EntryHooks._pre, reason=_EAGER_ENTRY)
_entry_post_eagerly = torch.compiler.disable(EntryHooks._post, reason=_EAGER_ENTRY)
