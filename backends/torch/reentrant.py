"""Reentrant checkpointing of a plain function under O1: repaired where the forward's
casting is known, warned about where it is not.

``torch.utils.checkpoint(fn, ..., use_reentrant=True)`` recomputes ``fn`` during backward with
autocast restored but without O1's op-casting mode (:class:`~mixprec_torch.autocast.PolicyMode`)
and offers no ``context_fn`` to put it back; a checkpointed *module* is recomputed through its
entry hooks (:mod:`mixprec_torch.recompute`), a plain function has none, so its gradients
would come out slightly different from the forward's, silently.

:class:`ReentrantCheck` looks at the autograd graph at the end of a wrapped model's forward.
The checkpoint's graph node holds the function it will recompute; when the model's casting
gives every plain function the same decision context (no module of the user's own has a
module rule), the check replaces that function with a :class:`Recompute` that runs it under
the forward's op casting, and the gradients are those of the same model without
checkpointing. Otherwise (a plain function may run inside a ruled module, whose context a
graph node does not record) it warns (:class:`ReentrantCheckpointWarning`) with the two fixes.

Cost: the graph is walked (iteratively, each node once, at most :data:`MAX_NODES` nodes) at
the end of the first :data:`CHECKED_FORWARDS` forwards that build a graph; after that only
on models where a plain function was found and repaired (it is checkpointed anew each
forward), about 2 microseconds per graph node. Never while ``torch.compile`` traces, under
``no_grad``/``inference_mode`` or during backward.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.errors import MixprecWarning

from .decisions import DecisionContext
from .sites import ModuleSite
from .torch_private import (
    in_backward,
    reentrant_checkpoint_function,
    set_reentrant_checkpoint_function,
)

__all__ = [
    "CHECKED_FORWARDS",
    "MAX_NODES",
    "Recompute",
    "ReentrantCheck",
    "ReentrantCheckpointWarning",
    "plain_function_context",
]

CHECKED_FORWARDS = 3
"""How many forwards with an autograd graph :class:`ReentrantCheck` looks at (a model
checkpoints the same functions on every training forward; a few cover a first evaluation
or warm-up forward that differs)."""

MAX_NODES = 200_000
"""The most autograd nodes one check visits (a GPT-2-sized graph has a few thousand)."""

_TORCH_DIR = str(Path(torch.__file__).parent)
_OWN_DIR = str(Path(__file__).parent)


Restore = Callable[[], AbstractContextManager[None]]
"""Opens the forward's op casting around a recomputation (``autocast.recomputation``)."""


class ReentrantCheckpointWarning(MixprecWarning):
    """A plain function is checkpointed with ``use_reentrant=True`` inside a module of a
    wrapped O1 model that has a module rule of its own (so mixprec cannot tell which module's
    op casting the recomputation needs): its recomputation in backward runs without O1's
    op casting, so its gradients differ slightly from the forward's. Checkpoint a module
    instead, or pass ``use_reentrant=False, context_fn=mixprec.torch.checkpoint_context``."""


class Recompute:
    """A reentrant checkpoint's plain function, recomputed under the forward's op casting.

    :param fn: the checkpointed function.
    :param restore: opens the forward's op-casting mode and decision context.
    """

    def __init__(self, fn: Callable[..., Any], restore: Restore) -> None:
        self.fn = fn
        self.restore = restore

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.restore():
            return self.fn(*args, **kwargs)


def recomputed_by_hooks(fn: Callable[..., Any]) -> bool:
    """Whether a reentrant recomputation of ``fn`` runs through module hooks: a module, a
    bound method of one (``layer.__call__``, as Hugging Face passes), a ``functools.partial``
    of either, or ``checkpoint_sequential``'s own runner of module segments."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if isinstance(fn, Recompute):  # repaired by an earlier check
        return True
    if isinstance(fn, nn.Module) or isinstance(getattr(fn, "__self__", None), nn.Module):
        return True
    return getattr(fn, "__module__", None) == "torch.utils.checkpoint"


def plain_checkpoints(
    output: Any, limit: int = MAX_NODES
) -> Iterator[tuple[Any, Callable[..., Any]]]:
    """(graph node, function) for each reentrant checkpoint in the autograd graph of
    ``output`` (tensors in any nesting of tuples, lists and dicts) whose function would be
    recomputed without module hooks, in graph order."""
    nodes: list[Any] = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
    seen: set[Any] = set()
    while nodes and len(seen) < limit:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        fn = reentrant_checkpoint_function(node)
        if fn is not None and not recomputed_by_hooks(fn):
            yield node, fn
        nodes.extend(next_node for next_node, _ in node.next_functions)


def plain_functions(output: Any, limit: int = MAX_NODES) -> list[Callable[..., Any]]:
    """The distinct functions of :func:`plain_checkpoints`, in graph order."""
    found: list[Callable[..., Any]] = []
    for _, fn in plain_checkpoints(output, limit):
        if fn not in found:
            found.append(fn)
    return found


def plain_function_context(
    sites: list[ModuleSite], *, root_island: bool, root_context: bool
) -> tuple[bool, DecisionContext | None]:
    """Whether every plain function a wrapped model's forward calls runs in one known decision
    context, and that context.

    A plain function runs in the context of the innermost ruled module calling it. PyTorch's
    own modules (BatchNorm, LayerNorm...) call none, so when only they have rules every plain
    function runs in the root's context (its own if the root has a rule, else none); a rule
    on a module of the user's own (or a root island) leaves it unknown.
    """
    root = sites[0]
    known = not root_island and all(
        type(site.module).__module__.startswith("torch.") for site in sites[1:] if site.has_rule
    )
    return known, DecisionContext(root.name, root.classes) if root_context else None


def _tensors(output: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    pending = [output]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, dict):  # Hugging Face's ModelOutput is a dict too
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
    return out


def _name(fn: Callable[..., Any]) -> str:
    qualname = getattr(fn, "__qualname__", None)
    if qualname is None:
        return repr(fn)
    module = getattr(fn, "__module__", None)
    return f"{module}.{qualname}" if module else str(qualname)


def _user_stacklevel() -> int:
    """The stacklevel of the first frame outside torch and this backend (the user's call)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith((_TORCH_DIR, _OWN_DIR)):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level


class ReentrantCheck:
    """Repairs (or, where the casting is unknown, warns once per function about) reentrant
    checkpoints of plain functions in one wrapped model's forwards.

    :param label: the policy's label, for the message.
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self.remaining = CHECKED_FORWARDS
        self.repairing = False
        """A plain function was repaired: every later forward is looked at too."""
        self.warned: set[str] = set()

    @property
    def due(self) -> bool:
        """Whether the next forward's graph is to be looked at."""
        return self.repairing or self.remaining > 0

    def after_forward(self, output: Any, restore: Restore | None) -> None:
        """Look at the graph of one forward's output (the root's post-hook calls this while
        :attr:`due` and the op-casting mode is on, outside ``torch.compile``).

        :param restore: opens the forward's op casting around a recomputation, or None when
            a plain function's decision context cannot be known (then: warn).
        """
        if not torch.is_grad_enabled() or in_backward():
            return
        if not any(t.grad_fn is not None for t in _tensors(output)):
            return
        if self.remaining:
            self.remaining -= 1
        for node, fn in plain_checkpoints(output):
            if restore is not None:
                set_reentrant_checkpoint_function(node, Recompute(fn, restore))
                self.repairing = True
                continue
            name = _name(fn)
            if name in self.warned:
                continue
            self.warned.add(name)
            warnings.warn(
                f"mixprec: {name} is checkpointed with torch.utils.checkpoint(..., "
                f"use_reentrant=True) as a plain function inside a model whose own modules "
                f"have module rules; reentrant checkpointing recomputes it in backward without "
                f"policy {self.label}'s op casting, so its gradients differ slightly from the "
                "forward's. Checkpoint a module that calls it instead "
                "(checkpoint(self.block, x)), or pass use_reentrant=False, "
                "context_fn=mixprec.torch.checkpoint_context",
                ReentrantCheckpointWarning,
                stacklevel=_user_stacklevel(),
            )
