"""A warning for the one checkpointing case O1 cannot repair: a plain function under
``torch.utils.checkpoint(..., use_reentrant=True)``.

Reentrant checkpointing recomputes the function during backward with autocast restored but
without O1's op-casting mode (:class:`~mixprec_torch.autocast.PolicyMode`), and offers no
``context_fn`` to put it back; a checkpointed *module* is recomputed through its entry hooks
(:mod:`mixprec_torch.recompute`), a plain function has none. Its gradients then come out
slightly different from the forward's, silently. :class:`ReentrantCheck` looks at the
autograd graph of a wrapped model's first few forwards and warns
(:class:`ReentrantCheckpointWarning`) for each such function, naming the two fixes.

Cost: the graph is walked (iteratively, each node once, at most :data:`MAX_NODES` nodes) at
the end of at most :data:`CHECKED_FORWARDS` forwards that build a graph, then never again;
never while ``torch.compile`` traces, under ``no_grad``/``inference_mode`` or during backward.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.errors import MixprecWarning

from .torch_private import in_backward, reentrant_checkpoint_function

__all__ = ["CHECKED_FORWARDS", "MAX_NODES", "ReentrantCheck", "ReentrantCheckpointWarning"]

CHECKED_FORWARDS = 3
"""How many forwards with an autograd graph :class:`ReentrantCheck` looks at (a model
checkpoints the same functions on every training forward; a few cover a first evaluation
or warm-up forward that differs)."""

MAX_NODES = 200_000
"""The most autograd nodes one check visits (a GPT-2-sized graph has a few thousand)."""

_TORCH_DIR = str(Path(torch.__file__).parent)
_OWN_DIR = str(Path(__file__).parent)


class ReentrantCheckpointWarning(MixprecWarning):
    """A plain function is checkpointed with ``use_reentrant=True`` inside a wrapped model
    whose O1 policy casts ops autocast does not: its recomputation in backward runs without
    that casting, so its gradients differ slightly from the forward's. Checkpoint a module
    instead, or pass ``use_reentrant=False, context_fn=mixprec.torch.checkpoint_context``."""


def recomputed_by_hooks(fn: Callable[..., Any]) -> bool:
    """Whether a reentrant recomputation of ``fn`` runs through module hooks: a module, a
    bound method of one (``layer.__call__``, as Hugging Face passes), a ``functools.partial``
    of either, or ``checkpoint_sequential``'s own runner of module segments."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if isinstance(fn, nn.Module) or isinstance(getattr(fn, "__self__", None), nn.Module):
        return True
    return getattr(fn, "__module__", None) == "torch.utils.checkpoint"


def plain_functions(output: Any, limit: int = MAX_NODES) -> list[Callable[..., Any]]:
    """The callables reentrant checkpoints in the autograd graph of ``output`` (tensors in
    any nesting of tuples, lists and dicts) recompute without module hooks, in graph order."""
    nodes: list[Any] = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
    seen: set[Any] = set()
    found: list[Callable[..., Any]] = []
    while nodes and len(seen) < limit:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        fn = reentrant_checkpoint_function(node)
        if fn is not None and not recomputed_by_hooks(fn) and fn not in found:
            found.append(fn)
        nodes.extend(next_node for next_node, _ in node.next_functions)
    return found


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
    """Warns once per function for reentrant checkpoints of plain functions in the first
    :data:`CHECKED_FORWARDS` forwards of one wrapped model that build a graph.

    :param label: the policy's label, for the message.
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self.remaining = CHECKED_FORWARDS
        self.warned: set[str] = set()

    def after_forward(self, output: Any) -> None:
        """Look at the graph of one forward's output (the root's post-hook calls this only
        while :attr:`remaining` and the op-casting mode is on, outside ``torch.compile``)."""
        if not torch.is_grad_enabled() or in_backward():
            return
        if not any(t.grad_fn is not None for t in _tensors(output)):
            return
        self.remaining -= 1
        for fn in plain_functions(output):
            name = _name(fn)
            if name in self.warned:
                continue
            self.warned.add(name)
            warnings.warn(
                f"mixprec: {name} is checkpointed with torch.utils.checkpoint(..., "
                f"use_reentrant=True) as a plain function; reentrant checkpointing recomputes "
                f"it in backward without policy {self.label}'s op casting, so its gradients "
                "differ slightly from the forward's. Checkpoint a module that calls it "
                "instead (checkpoint(self.block, x)), or pass use_reentrant=False, "
                "context_fn=mixprec.torch.checkpoint_context",
                ReentrantCheckpointWarning,
                stacklevel=_user_stacklevel(),
            )
