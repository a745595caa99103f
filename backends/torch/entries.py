"""Entries: a module of a wrapped model called on its own runs as the whole model would.

The modules a user may call on their own (the root's children, and every module that holds
others: ``model.encoder``, ``model.encoder.layer[3]``, ``self.net``) get an *entry* where they
would run differently without the model's boundary (all of them under O1's op casting; those
whose parameters are low precision under O2/O3). Called from outside the model's forward
(``model.encoder(x)``, ``self.net(x)`` in a LightningModule's ``training_step``), an entry
opens the same region (its nearest ruled ancestor's decision context), turns autocast off
under a pinned ancestor, casts its inputs to its own dtype and its outputs to
``policy.output``, exactly as the root would. Inside the model's forward it only reads one
counter (:attr:`Owner.depth`) and does nothing. Called during backward
(``torch.utils.checkpoint`` recomputing it) it does nothing either: the recomputation runs
in the forward's regions already (:mod:`mixprec_torch.regions`), without boundary casts, as
inside the forward.

A hooked module takes PyTorch's slower call path (measured on this CPU: 2.5 µs a call
without hooks, 8.3 µs with an entry's two), so leaves deeper down (a single ``Linear``
inside a block) get no entry: such a leaf called on its own runs as PyTorch runs it.

:data:`hooks_local` is this thread's stack of what each running hooked module opened, which
its post-hook closes (:func:`undo`); the island and context hooks of
:mod:`mixprec_torch.casting` use it too.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch
from torch import nn

from mixprec.dtypes import is_low_precision

from .dtypes import cast_floating, torch_dtype
from .regions import Region, anchor, pop, push
from .sites import ModuleSite
from .torch_private import in_backward
from .tracing import disable_autocast

__all__ = ["EntryHooks", "Owner", "ancestors", "entry_point", "hooks_local", "undo"]


class Owner(Protocol):
    """What an entry reads of its model's casting plan
    (:class:`~mixprec_torch.casting.ModelCasting` is one)."""

    depth: int
    cast_params: bool
    output_dtype: torch.dtype

    @property
    def casting(self) -> Any: ...
    @property
    def intercepts(self) -> bool: ...
    @property
    def autocast_on(self) -> bool: ...
    def is_island(self, site: ModuleSite) -> bool: ...
    def context_region(self, site: ModuleSite) -> Region | None: ...
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


def entry_point(site: ModuleSite) -> bool:
    """Whether users plausibly call this module on its own: a child of the root, or a
    module holding others (a block, an encoder)."""
    return "." not in site.name or next(site.module.children(), None) is not None


def ancestors(site: ModuleSite, by_name: dict[str, ModuleSite]) -> list[ModuleSite]:
    """The sites above ``site``, nearest first, root last."""
    out: list[ModuleSite] = []
    name = site.name
    while name:
        name = name.rpartition(".")[0]
        out.append(by_name[name])
    return out


class EntryHooks:
    """The boundary of one module called from outside its model's forward (see the module
    docstring)."""

    def __init__(self, owner: Owner, site: ModuleSite, ancestors: list[ModuleSite]) -> None:
        self.owner = owner
        self.input = (
            torch_dtype(site.dtype) if owner.cast_params and is_low_precision(site.dtype) else None
        )
        ruled = [a for a in ancestors if a.has_rule]
        self.region = owner.context_region(ruled[0]) if ruled else None
        self.autocast_off = any(owner.is_island(a) for a in ancestors) and owner.autocast_on

    def pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        owner = self.owner
        if owner.depth:
            return None  # inside the model's forward: the root's boundary holds already
        if torch.compiler.is_compiling():
            return _entry_pre_eagerly(self, module, args, kwargs)
        return self._pre(module, args, kwargs)

    def _pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if in_backward():
            # torch.utils.checkpoint recomputing this module: it runs in the forward's
            # regions already (mixprec_torch.regions), without boundary casts, as it did
            return None
        owner = self.owner
        undo: list[Any] = []
        try:
            casting = owner.casting
            if casting is not None:
                contexts = casting.enter()
                undo.append(lambda: casting.exit(contexts))
                if self.region is not None:
                    push(self.region)
                    undo.append(pop)
                if self.autocast_off:
                    undo.append(disable_autocast(casting.device_types))
        except BaseException:
            for step in reversed(undo):
                step()
            raise
        owner.depth += 1
        undo.append(owner.leave)
        hooks_local.stack.append((module, undo))
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
        if output is None:
            return None
        if self.owner.intercepts:
            anchor(output)
        return cast_floating(output, self.owner.output_dtype)


# A module compiled on its own (``torch.compile(model.encoder)``, not the wrapped root) runs
# its entry hooks eagerly: one graph break each, and its forward compiles inside the region
# they open (a compiled root opens it in its boundary, without a break).
_EAGER_ENTRY = (
    "mixprec: a module of a wrapped model compiled on its own opens its boundary eagerly; "
    "compile the wrapped model itself for no graph break"
)
_entry_pre_eagerly = torch.compiler.disable(EntryHooks._pre, reason=_EAGER_ENTRY)
_entry_post_eagerly = torch.compiler.disable(EntryHooks._post, reason=_EAGER_ENTRY)
