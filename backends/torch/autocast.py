"""O1: op-level casting that follows the policy, built on ``torch.autocast``.

A wrapped model's forward runs inside a *region*:

1. ``torch.autocast(device_type, dtype=policy.compute)`` when the policy casts ops (O1-style)
   and computes in low precision. Its C++ dispatch does the bulk of the work fast: matrix
   products in low precision, with the weight casts cached for the forward.
2. A :class:`torch.overrides.TorchFunctionMode` (:class:`PolicyMode`), only when needed. At
   wrap time every family's representative calls are run under the same autocast setting
   (:func:`mixprec_torch.ops.autocast_dtypes`) and compared with ``Policy.decide``; the mode
   intercepts exactly the families where they disagree (CPU autocast leaves ``softmax``,
   ``layer_norm``, ``exp``... in bfloat16, the default policy wants float32), the families
   that module rules name, ``"torch:<name>"`` ops, and banned ops. For an intercepted call it
   asks ``Policy.decide`` (cached: decide is pure) with the dtypes of the floating inputs and
   the innermost module that has a rule of its own, casts the floating inputs to that dtype
   and runs the call with autocast off. Everything else goes straight through.

Module rules: a module the policy pins to a dtype is an *island*
(:mod:`mixprec_torch.casting`): its forward pre-hook turns autocast off and casts the
inputs to the pinned dtype, its post-hook turns autocast back on. Modules with rules of
their own push a decision context that :class:`PolicyMode` reads, so op rules inside a
module rule apply there only.

Decisions are looked up, not made, while a forward runs:
:class:`~mixprec_torch.decisions.Decisions` holds ``Policy.decide``'s answers for every
intercepted op, decision context and input dtypes, prepared at wrap time. That, and
:class:`~mixprec_torch.tracing.TracedForward` (the region as ``with`` blocks while
``torch.compile`` traces, where hooks cannot hold it), lets a wrapped model compile without
graph breaks.

Only what runs inside a wrapped model's forward is cast. Outputs leave the model in
``policy.output`` (float32 for O1/O2), so a loss computed outside runs in float32.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from mixprec.dtypes import is_low_precision
from mixprec.errors import PolicyError
from mixprec.policy import Policy

from .decisions import DecisionContext, Decisions, InputKey, input_key
from .dtypes import FLOATING, cast_floating, torch_dtype
from .ops import NORM_ARGS, NORM_PARAMS_KW, NORM_STATS_KW, TORCH_OPS, callables_for
from .probes import autocast_dtypes, probe
from .tracing import autocast_each

__all__ = [
    "DecisionContext",
    "OpCasting",
    "PolicyMode",
    "active_casting",
    "autocast_off",
    "context_stack",
    "disable_autocast",
    "intercepted_ops",
    "recomputation",
    "region",
]


class _Local(threading.local):
    def __init__(self) -> None:
        self.contexts: list[DecisionContext] = []
        self.regions: list[tuple[list[Any], TorchFunctionMode | None]] = []


_local = _Local()


def context_stack() -> list[DecisionContext]:
    """This thread's stack of module decision contexts (innermost last)."""
    return _local.contexts


def active_casting() -> OpCasting | None:
    """The op casting whose :class:`PolicyMode` the innermost open region runs (None outside
    a region, or when that region runs autocast alone)."""
    regions = _local.regions
    mode = regions[-1][1] if regions else None
    return mode.casting if isinstance(mode, PolicyMode) else None


# ------------------------------------------------------------------------------------------
# Which families need interception
# ------------------------------------------------------------------------------------------


def _probe_lowp(policy: Policy) -> torch.dtype:
    for dtype in (policy.compute, policy.param):
        if dtype != "auto" and is_low_precision(dtype):
            return torch_dtype(dtype)
    return torch.bfloat16


def intercepted_ops(policy: Policy, device_types: Sequence[str]) -> frozenset[str]:
    """The ops (families and ``"torch:"`` names) the mode must handle for ``policy``.

    A family is left to autocast (or to native PyTorch when autocast is off) only when every
    probe of it, on every device type, produced the dtype ``policy.decide`` gives for the
    same inputs. Probes the native op refuses (mixed dtypes without autocast) are ignored:
    such calls fail the same way in plain PyTorch.
    """
    autocast = autocast_dtype(policy)
    lowp = _probe_lowp(policy)
    ops: set[str] = set()
    for device_type in device_types:
        probed = autocast_dtypes(device_type, autocast, lowp)
        for key, produced in probed.items():
            family, index, inputs = key
            if family in ops:
                continue
            try:
                expected = policy.decide(family, inputs).dtype
            except PolicyError:  # banned: the mode raises the policy's error
                ops.add(family)
                continue
            if produced is None:
                # refused under autocast but not without it (CPU autocast's promote rule
                # rejects float16 inputs): the policy's rule is applied instead
                config = tuple(torch_dtype(d) for d in inputs)
                if autocast is not None and probe(device_type, None, family, index, config):
                    ops.add(family)
            elif produced != expected:
                ops.add(family)
    for op in policy.ops.listed:
        if op.startswith("torch:"):
            ops.add(op)
    for rule in policy.modules:
        ops.update(op for op, _ in rule.ops if op in TORCH_OPS or op.startswith("torch:"))
    return frozenset(ops)


def autocast_dtype(policy: Policy) -> torch.dtype | None:
    """The dtype ``torch.autocast`` runs with for ``policy``, or None when it stays off."""
    if policy.casts_ops and policy.compute != "auto" and is_low_precision(policy.compute):
        return torch_dtype(policy.compute)
    return None


# ------------------------------------------------------------------------------------------
# The mode
# ------------------------------------------------------------------------------------------


_NormPositions = tuple[tuple[int, int], tuple[int, int]]
"""Positions of a norm's running statistics and of its weight and bias (see ``NORM_ARGS``)."""
_Entry = tuple[str, _NormPositions | None]


def _norm_call(
    args: Sequence[Any],
    kwargs: dict[str, Any],
    dtype: torch.dtype,
    positions: _NormPositions,
) -> tuple[list[Any], dict[str, Any], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Arguments for a batch/instance norm run in ``dtype``.

    Float32 weights and statistics stay as they are under a low-precision input (the kernels
    take that mix); otherwise they are cast, and cast statistics are written back after the
    call, because the norm updates them in place.
    """
    stats_pos, params_pos = positions
    writeback: list[tuple[torch.Tensor, torch.Tensor]] = []
    lowp = dtype != torch.float32

    def convert(value: Any, stats: bool) -> Any:
        if (
            not isinstance(value, torch.Tensor)
            or value.dtype not in FLOATING
            or value.dtype == dtype
        ):
            return value
        if lowp and value.dtype == torch.float32:
            return value
        cast = value.detach().to(dtype) if stats else value.to(dtype)
        if stats:
            writeback.append((value, cast))
        return cast

    new_args = []
    for i, a in enumerate(args):
        if i in stats_pos:
            new_args.append(convert(a, True))
        elif i in params_pos:
            new_args.append(convert(a, False))
        else:
            new_args.append(cast_floating(a, dtype))
    new_kwargs = {}
    for k, v in kwargs.items():
        if k in NORM_STATS_KW:
            new_kwargs[k] = convert(v, True)
        elif k in NORM_PARAMS_KW:
            new_kwargs[k] = convert(v, False)
        else:
            new_kwargs[k] = cast_floating(v, dtype)
    return new_args, new_kwargs, writeback


class PolicyMode(TorchFunctionMode):
    """Intercepts the torch callables of the ops :func:`intercepted_ops` chose and runs each
    in the dtype ``Policy.decide`` gives, with autocast off for the call."""

    def __init__(self, casting: OpCasting) -> None:
        super().__init__()
        self.casting = casting

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Iterable[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        entry = self.casting.table.get(func)
        if entry is None:
            return func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        dtype = self.casting.dtype_for(entry[0], input_key(args, kwargs))
        norm = entry[1]
        if norm is not None:
            new_args, new_kwargs, writeback = _norm_call(args, kwargs, dtype, norm)
            if torch.compiler.is_compiling():
                out = autocast_each(self.casting.device_types, None, func, *new_args, **new_kwargs)
            else:
                with autocast_off(self.casting.device_types):
                    out = func(*new_args, **new_kwargs)
            if writeback:
                with torch.no_grad():
                    for original, cast in writeback:
                        original.copy_(cast)
            return out
        new_args = [cast_floating(a, dtype) for a in args]
        new_kwargs = {k: v if k == "out" else cast_floating(v, dtype) for k, v in kwargs.items()}
        if torch.compiler.is_compiling():
            return autocast_each(self.casting.device_types, None, func, *new_args, **new_kwargs)
        with autocast_off(self.casting.device_types):
            return func(*new_args, **new_kwargs)


def disable_autocast(device_types: Sequence[str]) -> Callable[[], None]:
    """Turn autocast off for ``device_types``; return the call that turns it back on.

    Only the enabled flag changes (the nesting level and the weight-cast cache stay), so
    an island inside an autocast region costs two flag flips per device type.
    """
    was_on = [dt for dt in device_types if torch.is_autocast_enabled(dt)]
    for dt in was_on:
        torch.set_autocast_enabled(dt, False)

    def restore() -> None:
        for dt in was_on:
            torch.set_autocast_enabled(dt, True)

    return restore


@contextmanager
def autocast_off(device_types: Sequence[str]) -> Iterator[None]:
    """Autocast disabled for ``device_types`` (restored afterwards, nesting level untouched)."""
    restore = disable_autocast(device_types)
    try:
        yield
    finally:
        restore()


# ------------------------------------------------------------------------------------------
# One policy's op-casting plan
# ------------------------------------------------------------------------------------------


@dataclass
class OpCasting:
    """How one wrapped model casts ops: the autocast dtype and the intercepted callables.

    :param policy: the resolved policy.
    :param device_types: the device types the model's tensors live on (``"cpu"``, ``"cuda"``).
    """

    policy: Policy
    device_types: tuple[str, ...]
    autocast: torch.dtype | None = field(init=False)
    ops: frozenset[str] = field(init=False)
    table: dict[Callable[..., Any], _Entry] = field(init=False)
    """Intercepted callable -> (its op name, its norm argument positions or None)."""
    decisions: Decisions = field(init=False)
    """``Policy.decide``'s answers for the intercepted ops, prepared at wrap time."""

    def __post_init__(self) -> None:
        self.autocast = autocast_dtype(self.policy)
        self.ops = intercepted_ops(self.policy, self.device_types)
        table: dict[Callable[..., Any], _Entry] = {}
        # neutral families first, so a "torch:" name for the same callable wins
        for op in sorted(self.ops, key=lambda o: o.startswith("torch:")):
            for fn in callables_for(op):
                table[fn] = (op, NORM_ARGS.get(fn))
        self.table = table
        self.decisions = Decisions(self.policy, self.ops)
        self.decisions.prepare(None)

    @property
    def active(self) -> bool:
        """Whether a region does anything at all (autocast or the mode)."""
        return self.autocast is not None or bool(self.table)

    def mode(self) -> PolicyMode:
        """A fresh op-casting mode for this plan (:class:`~mixprec_torch.tracing.TracedForward`
        enters it in a ``with`` block)."""
        return PolicyMode(self)

    def dtype_for(self, op: str, key: InputKey) -> torch.dtype:
        """The dtype ``op`` runs in for inputs ``key`` (:func:`input_key`) in the current
        module context: a lookup in the answers prepared at wrap time."""
        contexts = _local.contexts
        return self.decisions.dtype(op, contexts[-1] if contexts else None, key)

    # --------------------------------------------------------------------- regions

    def enter(self) -> None:
        """Start a region (the forward pre-hook of a wrapped model calls this)."""
        contexts: list[Any] = []
        mode: TorchFunctionMode | None = None
        try:
            if self.autocast is not None:
                for device_type in self.device_types:
                    ctx = torch.autocast(device_type, dtype=self.autocast)
                    ctx.__enter__()
                    contexts.append(ctx)
            if self.table:
                mode = PolicyMode(self)
                mode.__enter__()
        except BaseException:
            for ctx in reversed(contexts):
                ctx.__exit__(None, None, None)
            raise
        _local.regions.append((contexts, mode))

    def exit(self) -> None:
        """End the innermost region (the forward post-hook calls this, even on errors)."""
        contexts, mode = _local.regions.pop()
        if mode is not None:
            mode.__exit__(None, None, None)
        for ctx in reversed(contexts):
            ctx.__exit__(None, None, None)


@contextmanager
def region(casting: OpCasting) -> Iterator[None]:
    """Run a block as a wrapped model's forward would run (used by tests and conformance)."""
    casting.enter()
    try:
        yield
    finally:
        casting.exit()


@contextmanager
def recomputation(casting: OpCasting, context: DecisionContext | None) -> Iterator[None]:
    """The op-casting mode and decision context of a forward, around a recomputation of part
    of it during backward (activation checkpointing).

    Autocast is not entered here: ``torch.utils.checkpoint`` restores the forward's autocast
    state itself (on, or off inside a float32 island), and entering it again would turn it on
    inside an island.
    """
    contexts = context_stack()
    if context is not None:
        contexts.append(context)
    try:
        with PolicyMode(casting):
            yield
    finally:
        if context is not None:
            contexts.pop()
