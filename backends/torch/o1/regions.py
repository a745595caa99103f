"""Which mixprec region an op runs in: the one question O1's kernels ask.

O1 decides each op's dtype in kernels at torch's Autocast dispatch keys
(:mod:`mixprec_torch.o1.autocast_kernels`). A kernel asks :func:`current` for the :class:`Region` in
force: one wrapped model's op casting in one module decision context. Three things hold regions:

1. **This thread's stack.** A wrapped model's forward pushes its region (:func:`push`) and
   pops it when the forward returns (:func:`pop`); a module with rules of its own pushes its
   context's region inside. ``None`` on the stack suspends every region (apex's
   ``disable_casts``).
2. **A compilation.** While ``torch.compile`` traces a wrapped model, its forward opens
   regions through two custom operators, ``mixprec::enter_region`` and
   ``mixprec::exit_region``, which dynamo keeps in the graph. Their fake kernels push onto a
   stack that belongs to the running compilation (AOTAutograd runs them again when it traces
   the graph), so the kernels decide while the graph is traced and the compiled code holds
   the casts; a compilation that stops half-way leaves nothing behind. Run for real (a
   forward dynamo runs eagerly), they push onto this thread's stack.
3. **The forwards a backward belongs to.** Activation checkpointing recomputes part of a
   forward during backward, after the forward returned. Every autograd node gets a sequence
   number when it is created, increasing per thread; while a region is open and autograd
   records, a :class:`Record` notes the sequence numbers at which the region in force
   changed. A recomputation runs inside the backward of a node the forward created (the
   checkpoint's own node when reentrant, the node that unpacks a saved tensor when not), so
   the region that was in force when that node was created is the one the recomputation
   runs in, whatever torch re-runs (a function, a bound method, a ``functools.partial``, a
   lambda, ``checkpoint_sequential``). A record lives as long as the forward's autograd graph
   (it hangs on the output's nodes); the last :data:`KEPT` of each thread are kept as well.
   A checkpoint nested inside a recomputed plain function is created during backward and has
   no record (pass :func:`mixprec.torch.checkpoint_context` there).
"""

from __future__ import annotations

import bisect
import itertools
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from mixprec.errors import PolicyError

from ..torch_private import (
    never_compiled,
    next_sequence_nr,
    running_node_sequence_nr,
    tracing_context,
)

__all__ = [
    "KEPT",
    "Handler",
    "Record",
    "Region",
    "anchor",
    "current",
    "open_regions",
    "pop",
    "push",
    "region_by_id",
    "suspended",
]

KEPT = 8
"""Records of each thread kept alive besides those their autograd graphs hold (outputs no
graph node can hang on: a custom object)."""


class Handler(Protocol):
    """Runs one ATen operator as a region decides (a cast, a ban, later an FP8 GEMM)."""

    def run(self, region: Region, kernel: Any, keyset: Any, args: Any, kwargs: Any) -> Any:
        """Run ``kernel``'s operator on ``args``/``kwargs`` under ``region``."""
        ...


_ids = itertools.count(1)
_by_id: weakref.WeakValueDictionary[int, Region] = weakref.WeakValueDictionary()


class Region:
    """One op casting in one module decision context, as the kernels read it.

    :param handlers: ATen operator (``"aten::softmax.int"``) -> how a kernel at an Autocast
        key runs it; operators not named run as torch runs them.
    :param bans: ATen operator -> how a kernel at an Autograd key runs it (regions without
        autocast that ban an op).
    :param answers: the prepared ``Policy.decide`` answers of this context: (op, input key)
        -> dtype, or the ``PolicyError`` to raise.
    :param decide: the answer for a key not prepared (decided on first use, remembered).
    """

    __slots__ = ("__weakref__", "answers", "bans", "decide", "handlers", "id")

    def __init__(
        self,
        handlers: dict[str, Handler],
        bans: dict[str, Handler],
        answers: dict[Any, Any],
        decide: Callable[[str, Any], Any],
    ) -> None:
        self.handlers = handlers
        self.bans = bans
        self.answers = answers
        self.decide = decide
        self.id = next(_ids)
        """Names the region inside a compiled graph (``mixprec::enter_region``)."""
        _by_id[self.id] = self

    def dtype(self, op: str, key: Any) -> torch.dtype:
        """The dtype ``op`` runs in for inputs ``key`` here.

        :raises PolicyError: the policy bans ``op`` here (or its rules are ambiguous).
        """
        answer = self.answers.get((op, key))
        if answer is None:
            answer = self.decide(op, key)
        if isinstance(answer, PolicyError):
            raise PolicyError(*answer.args)
        return answer  # type: ignore[no-any-return]


def region_by_id(region_id: int) -> Region:
    """The live region with this id (what a compiled graph names)."""
    return _by_id[region_id]


# ------------------------------------------------------------------------------------------
# Records: the regions in force while the nodes of a forward's graph were created
# ------------------------------------------------------------------------------------------


class Record:
    """The regions in force over a range of one thread's autograd sequence numbers.

    :param base: the stack depth below the region that opened the record.
    """

    __slots__ = ("__weakref__", "base", "end", "regions", "seqs", "start", "thread")

    def __init__(self, base: int) -> None:
        self.base = base
        self.thread = threading.get_ident()
        self.start = next_sequence_nr()
        self.end = 1 << 62
        self.seqs: list[int] = []
        self.regions: list[Region | None] = []

    def note(self, region: Region | None) -> None:
        """From the next node on, ``region`` is in force."""
        seq = next_sequence_nr()
        if self.seqs and self.seqs[-1] == seq:  # no node in between: replace
            self.regions[-1] = region
        else:
            self.seqs.append(seq)
            self.regions.append(region)

    def at(self, seq: int) -> Region | None:
        """The region in force when the node numbered ``seq`` was created."""
        index = bisect.bisect_right(self.seqs, seq) - 1
        return self.regions[index] if index >= 0 else None


_records: weakref.WeakSet[Record] = weakref.WeakSet()
_records_lock = threading.Lock()


def _close(record: Record) -> None:
    record.end = next_sequence_nr()
    if record.end == record.start:
        return  # no node was created: nothing can recompute
    _local.closed = record
    _local.kept.append(record)
    with _records_lock:
        _records.add(record)


def anchor(output: Any) -> None:
    """Keep the record the forward that returned ``output`` just closed (if any) as long as
    ``output``'s autograd graph: a backward through it may recompute part of the forward."""
    record = _local.closed
    if record is None:
        return
    _local.closed = None
    for tensor in _tensors(output):
        node = tensor.grad_fn
        if node is not None:
            metadata: dict[str, Any] = node.metadata  # type: ignore[assignment]
            metadata["mixprec.regions"] = record


def _recomputing() -> Region | None:
    """The region a recomputation in backward belongs to (None outside backward, or for a
    node no recorded region created)."""
    seq = running_node_sequence_nr()
    if seq is None:
        return None
    cache = _local.cache
    if cache is not None and cache[0] == seq:
        return cache[1]
    with _records_lock:
        records = list(_records)
    found: Region | None = None
    me = threading.get_ident()
    for record in records:
        if record.start <= seq < record.end:
            found = record.at(seq)
            if record.thread == me:
                break
    _local.cache = (seq, found)
    return found


def _tensors(output: Any) -> Iterator[torch.Tensor]:
    pending = [output]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, dict):  # Hugging Face's ModelOutput is a dict too
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)


# ------------------------------------------------------------------------------------------
# This thread's stack
# ------------------------------------------------------------------------------------------


class _Local(threading.local):
    def __init__(self) -> None:
        self.stack: list[Region | None] = []
        self.record: Record | None = None
        self.kept: deque[Record] = deque(maxlen=KEPT)
        self.cache: tuple[int, Region | None] | None = None
        self.closed: Record | None = None


_local = _Local()


def push(region: Region | None) -> None:
    """Open ``region`` on this thread (None: suspend every region until the matching pop)."""
    stack = _local.stack
    stack.append(region)
    record = _local.record
    if record is None:
        if region is None or not (region.handlers or region.bans) or not torch.is_grad_enabled():
            return  # nothing a recomputation would need
        record = _local.record = Record(len(stack) - 1)
    record.note(region)


def pop() -> None:
    """Close this thread's innermost region (then :func:`anchor` the forward's output)."""
    stack = _local.stack
    stack.pop()
    record = _local.record
    if record is None:
        return
    record.note(stack[-1] if stack else None)
    if len(stack) <= record.base:
        _local.record = None
        _close(record)


def open_regions() -> int:
    """How many regions this thread has open (suspensions included)."""
    return len(_local.stack)


@contextmanager
def suspended() -> Iterator[None]:
    """No region is in force inside the block (ops run as torch runs them)."""
    push(None)
    try:
        yield
    finally:
        pop()


# ------------------------------------------------------------------------------------------
# Compiled regions
# ------------------------------------------------------------------------------------------

_traced: weakref.WeakKeyDictionary[Any, list[Region]] = weakref.WeakKeyDictionary()
_tracing = [0]  # traced regions opened and not closed, process-wide: 0 skips the lookup


def _traced_top() -> Region | None:
    context = tracing_context()
    stack = _traced.get(context) if context is not None else None
    return stack[-1] if stack else None


def current() -> Region | None:
    """The region an op dispatched now runs in, or None (torch's own behaviour)."""
    if _tracing[0]:
        region = _traced_top()
        if region is not None:
            return region
    stack = _local.stack
    if stack:
        return stack[-1]
    return _recomputing()


def _enter(region: int) -> None:
    push(_by_id[region])


def _exit(region: int) -> None:
    stack = _local.stack
    while stack:  # down to the region itself (an error inside may have left others)
        top = stack[-1]
        pop()
        if top is not None and top.id == region:
            return


def _enter_traced(region: int) -> None:
    context = tracing_context()
    if context is None:
        _enter(region)
        return
    _traced.setdefault(context, []).append(_by_id[region])
    _tracing[0] += 1


def _exit_traced(region: int) -> None:
    context = tracing_context()
    stack = _traced.get(context) if context is not None else None
    if stack is None:
        _exit(region)
        return
    while stack:
        top = stack.pop()
        _tracing[0] = max(0, _tracing[0] - 1)
        if top.id == region:
            return


_LIB = torch.library.Library("mixprec", "FRAGMENT")
_LIB.define("enter_region(int region) -> ()")
_LIB.define("exit_region(int region) -> ()")
_LIB.impl("enter_region", _enter, "CompositeExplicitAutograd")
_LIB.impl("exit_region", _exit, "CompositeExplicitAutograd")
torch.library.register_fake("mixprec::enter_region", _enter_traced, lib=_LIB)
torch.library.register_fake("mixprec::exit_region", _exit_traced, lib=_LIB)
for _fn in (_enter, _exit, _enter_traced, _exit_traced, current, push, pop):
    never_compiled(_fn)
