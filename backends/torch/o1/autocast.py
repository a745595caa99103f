"""O1: op-level casting that follows the policy, decided where ``torch.autocast`` decides.

A wrapped model's forward runs inside a *region* (:meth:`OpCasting.enter`):

1. ``torch.autocast(device_type, dtype=policy.compute)`` when the policy casts ops (O1-style)
   and computes in low precision. Its C++ kernels at the Autocast dispatch key do the bulk
   of the work: matrix products in low precision, with the weight casts cached for the
   forward.
2. For the families where autocast and the policy disagree, mixprec's own kernels at the
   same key (:mod:`mixprec_torch.o1.autocast_kernels`). At wrap time every family's representative
   calls are run under the same autocast setting (:func:`mixprec_torch.o1.probes.autocast_dtypes`)
   and compared with ``Policy.decide``; the families where they differ (CPU autocast leaves
   ``softmax``, ``layer_norm``, ``exp``... in bfloat16, the default policy wants float32), the
   families that module rules name, ``"torch:<name>"`` ops and banned ops get a kernel for
   each of their ATen operators (:data:`mixprec_torch.ops.ATEN_OPS`). The region's
   :class:`~mixprec_torch.o1.regions.Region` says, per operator, what a :class:`CastHandler`
   does: look the dtype up (``Policy.decide``'s answer for the floating inputs' dtypes in the
   current module context, prepared at wrap time by
   :class:`~mixprec_torch.o1.decision_tables.Decisions`), cast the floating inputs, and run the
   operator with autocast's key excluded. Every other operator never leaves C++.

Because the decision lives in torch's dispatcher, whatever torch runs inside the region sees
it, and whatever re-runs part of the forward later is given its region back by
:mod:`mixprec_torch.o1.regions`: activation checkpointing's recomputation (any checkpointed
callable, both modes), ``torch.compile`` (the region is part of the traced graph), user
code that torch calls back. A nested ``torch.autocast(enabled=False)`` turns the policy off
inside, as it turns autocast off.

Module rules: a module the policy pins to a dtype is an *island*
(:mod:`mixprec_torch.wrapping.casting`): its forward pre-hook turns autocast off (and with it the
kernels) and casts the inputs to the pinned dtype, its post-hook turns autocast back on.
Modules with rules of their own open their context's region, so op rules inside a module rule
apply there only.

A region without autocast (O2/O3 under float16) decides no dtypes but still refuses the
policy's banned ops: :class:`BanHandler` s at the Autograd key
(:mod:`mixprec_torch.o1.autocast_kernels`), which ask one prepared question per op and
module context (``Decisions(..., bans_only=True)``), not O1's table of input keys.

Only what runs inside a wrapped model's forward is cast. Outputs leave the model in
``policy.output`` (float32 for O1/O2), so a loss computed outside runs in float32.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mixprec.errors import PolicyError
from mixprec.kit import Policy, is_low_precision

from ..dtypes import FLOATING, cast_floating, torch_dtype
from ..ops import ATEN_OPS, NORM_ARGS
from ..torch_private import dispatch_key, kernel_origin, registered_by_torch
from .aten import aten_ops
from .decision_tables import DTYPE_BITS, DecisionContext, Decisions, InputKey
from .probes import PROBES, autocast_dtypes, probe
from .regions import Handler, Region, pop, push
from .tracing import autocast_off, disable_autocast

__all__ = [
    "BanHandler",
    "CastHandler",
    "DecisionContext",
    "OpCasting",
    "autocast_dtype",
    "autocast_off",
    "disable_autocast",
    "intercepted_ops",
    "region",
]


# ------------------------------------------------------------------------------------------
# Which families need a kernel
# ------------------------------------------------------------------------------------------


def _probe_lowp(policy: Policy) -> torch.dtype:
    for dtype in (policy.compute, policy.param):
        if dtype != "auto" and is_low_precision(dtype):
            return torch_dtype(dtype)
    return torch.bfloat16


_KERNELS_PY = Path(__file__).with_name("autocast_kernels.py")
_OURS = (str(_KERNELS_PY), str(_KERNELS_PY.resolve()))


def _foreign_origins(device_type: str) -> frozenset[str]:
    """Where the kernels at ``device_type``'s Autocast key for the probed families' operators
    were registered, other than torch's own and mixprec's
    (:mod:`mixprec_torch.o1.autocast_kernels`)."""
    key = dispatch_key("Autocast", device_type)
    found = set()
    for family in PROBES:
        for name in aten_ops(family):
            origin = kernel_origin(name, key)
            if origin and not registered_by_torch(origin) and not any(o in origin for o in _OURS):
                found.add(f"{name}: {origin}")
    return frozenset(found)


def _banned(policy: Policy) -> set[str]:
    ops = set(policy.ops.banned)
    for rule in policy.modules:
        ops.update(op for op, lst in rule.ops if lst == "banned")
    return ops


def intercepted_ops(policy: Policy, device_types: Sequence[str]) -> frozenset[str]:
    """The ops (families and ``"torch:"`` names) whose operators get a kernel for ``policy``.

    Under autocast, a family is left to autocast only when every probe of it, on every
    device type, produced the dtype ``policy.decide`` gives for the same inputs. Probes the
    native op refuses (mixed dtypes without autocast) are ignored: such calls fail the same
    way in plain PyTorch. Without autocast (O2/O3), ops run as torch runs them and only the
    banned ones are intercepted.
    """
    autocast = autocast_dtype(policy)
    if autocast is None:
        return frozenset(op for op in _banned(policy) if aten_ops(op))
    lowp = _probe_lowp(policy)
    ops: set[str] = set()
    for device_type in device_types:
        # another library's autocast kernel changes what the probes see: part of the key
        others = _foreign_origins(device_type)
        probed = autocast_dtypes(device_type, autocast, lowp, others)
        for key, produced in probed.items():
            family, index, inputs = key
            if family in ops:
                continue
            try:
                expected = policy.decide(family, inputs).dtype
            except PolicyError:  # banned: the kernel raises the policy's error
                ops.add(family)
                continue
            if produced is None:
                # refused under autocast but not without it (CPU autocast's promote rule
                # rejects float16 inputs): the policy's rule is applied instead
                config = tuple(torch_dtype(d) for d in inputs)
                if probe(device_type, None, family, index, config):
                    ops.add(family)
            elif produced != expected:
                ops.add(family)
    for op in policy.ops.listed:
        if op.startswith("torch:"):
            ops.add(op)
    for rule in policy.modules:
        ops.update(op for op, _ in rule.ops if op in ATEN_OPS or op.startswith("torch:"))
    return frozenset(ops)


def autocast_dtype(policy: Policy) -> torch.dtype | None:
    """The dtype ``torch.autocast`` runs with for ``policy``, or None when it stays off."""
    if policy.casts_ops and policy.compute != "auto" and is_low_precision(policy.compute):
        return torch_dtype(policy.compute)
    return None


# ------------------------------------------------------------------------------------------
# Handlers: what a kernel does inside a region
# ------------------------------------------------------------------------------------------

_NormPositions = tuple[tuple[int, int], tuple[int, int]]
"""Positions of a norm's running statistics and of its weight and bias (see ``NORM_ARGS``)."""


def _norm_args(
    args: Sequence[Any], dtype: torch.dtype, positions: _NormPositions
) -> tuple[list[Any], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Arguments for a batch/instance norm run in ``dtype``.

    Float32 weights and statistics stay as they are under a low-precision input (the kernels
    take that mix); otherwise they are cast, and cast statistics are written back after the
    call, because the norm updates them in place.
    """
    stats_pos, params_pos = positions
    writeback: list[tuple[torch.Tensor, torch.Tensor]] = []
    lowp = dtype != torch.float32
    out: list[Any] = []
    for i, value in enumerate(args):
        if i not in stats_pos and i not in params_pos:
            out.append(cast_floating(value, dtype))
            continue
        if (
            not isinstance(value, torch.Tensor)
            or value.dtype not in FLOATING
            or value.dtype == dtype
            or (lowp and value.dtype == torch.float32)
        ):
            out.append(value)
        elif i in stats_pos:
            cast = value.detach().to(dtype)
            writeback.append((value, cast))
            out.append(cast)
        else:
            out.append(value.to(dtype))
    return out, writeback


def _slot_key(slots: Any, args: Any, kwargs: Any) -> InputKey:
    """The :data:`~mixprec_torch.o1.decision_tables.InputKey` of a call, read from its tensor
    arguments only (``slots``: see :attr:`mixprec_torch.o1.autocast_kernels.Kernel.slots`)."""
    first: torch.dtype | None = None
    mask = 0
    count = len(args)
    for index, name, many in slots:
        value = args[index] if index < count else kwargs.get(name)
        for item in value if many else (value,):
            if isinstance(item, torch.Tensor):
                bit = DTYPE_BITS.get(item.dtype, 0)
                if bit:
                    if first is None:
                        first = item.dtype
                    mask |= bit
    return first, mask


def _cast_slots(
    slots: Any, args: Any, kwargs: Any, dtype: torch.dtype
) -> tuple[list[Any], dict[str, Any]]:
    """``args`` and ``kwargs`` with every floating tensor argument cast to ``dtype``."""
    new_args = list(args)
    new_kwargs = kwargs
    count = len(args)
    for index, name, many in slots:
        value = args[index] if index < count else kwargs.get(name)
        if value is None:
            continue
        cast = [_cast(t, dtype) for t in value] if many else _cast(value, dtype)
        if index < count:
            new_args[index] = cast
        else:
            if new_kwargs is kwargs:
                new_kwargs = dict(kwargs)
            new_kwargs[name] = cast
    return new_args, new_kwargs


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype != dtype and value.dtype in DTYPE_BITS:
        return value.to(dtype)
    return value


class CastHandler:
    """Runs an operator of ``op`` (a family or a ``"torch:"`` name) in the dtype the region
    decides for its floating inputs, with the Autocast key excluded for the call.

    :param op: the op name the policy's rules use.
    :param norm: for batch/instance norm, the positions of the statistics and parameters.
    """

    __slots__ = ("norm", "op")

    def __init__(self, op: str, norm: _NormPositions | None = None) -> None:
        self.op = op
        self.norm = norm

    def run(self, region: Region, kernel: Any, keyset: Any, args: Any, kwargs: Any) -> Any:
        dtype = region.dtype(self.op, _slot_key(kernel.slots, args, kwargs))
        if self.norm is not None:
            new_args, writeback = _norm_args(args, dtype, self.norm)
            with kernel.below():
                out = kernel.op(*new_args, **kwargs)
            if writeback:
                with torch.no_grad():
                    for original, cast in writeback:
                        original.copy_(cast)
            return out
        new_args, new_kwargs = _cast_slots(kernel.slots, args, kwargs, dtype)
        with kernel.below():
            return kernel.op(*new_args, **new_kwargs)


class BanHandler:
    """At an Autograd key: raises the policy's error where the region bans ``op``, else runs
    the operator as torch does."""

    __slots__ = ("op",)

    def __init__(self, op: str) -> None:
        self.op = op

    def run(self, region: Region, kernel: Any, keyset: Any, args: Any, kwargs: Any) -> Any:
        region.dtype(self.op, _slot_key(kernel.slots, args, kwargs))  # raises where banned
        return kernel.passthrough(keyset, args, kwargs)


# ------------------------------------------------------------------------------------------
# One policy's op-casting plan
# ------------------------------------------------------------------------------------------


@dataclass
class OpCasting:
    """How one wrapped model casts ops: the autocast dtype, the operators mixprec decides,
    and the regions of its decision contexts.

    :param policy: the resolved policy.
    :param device_types: the device types the model's tensors live on (``"cpu"``, ``"cuda"``).
    """

    policy: Policy
    device_types: tuple[str, ...]
    autocast: torch.dtype | None = field(init=False)
    ops: frozenset[str] = field(init=False)
    handlers: dict[str, Handler] = field(init=False)
    """ATen operator -> what its kernel at the Autocast key does inside this plan's regions."""
    bans: dict[str, Handler] = field(init=False)
    """ATen operator -> its kernel at the Autograd key (regions without autocast only)."""
    decisions: Decisions = field(init=False)
    """``Policy.decide``'s answers for the intercepted ops, prepared at wrap time."""
    regions: dict[DecisionContext | None, Region] = field(init=False)

    def __post_init__(self) -> None:
        self.autocast = autocast_dtype(self.policy)
        self.ops = intercepted_ops(self.policy, self.device_types)
        handlers: dict[str, Handler] = {}
        bans: dict[str, Handler] = {}
        # neutral families first, so a "torch:" name for the same operator wins
        for op in sorted(self.ops, key=lambda o: o.startswith("torch:")):
            for name in aten_ops(op):
                if self.autocast is not None:
                    handlers[name] = CastHandler(op, NORM_ARGS.get(name.partition(".")[0]))
                else:
                    bans[name] = BanHandler(op)
        self.handlers, self.bans = handlers, bans
        self.decisions = Decisions(self.policy, self.ops, bans_only=self.autocast is None)
        self.regions = {}
        self.region(None)

    @property
    def active(self) -> bool:
        """Whether a region does anything at all (autocast or kernels)."""
        return self.autocast is not None or bool(self.handlers) or bool(self.bans)

    @property
    def intercepts(self) -> bool:
        """Whether some operator runs through mixprec's kernels in this plan's regions."""
        return bool(self.handlers) or bool(self.bans)

    def claims(self) -> Iterable[tuple[str, str, Any]]:
        """Every (ATen operator, device type, key kind) this plan needs a kernel at."""
        for device_type in self.device_types:
            for name in self.handlers:
                yield name, device_type, "Autocast"
            for name in self.bans:
                yield name, device_type, "Autograd"

    def region(self, context: DecisionContext | None) -> Region:
        """The region of one decision context (made once, at wrap time for the model's
        ruled modules: a compiled forward names it by its id)."""
        found = self.regions.get(context)
        if found is None:
            decisions = self.decisions
            found = self.regions[context] = Region(
                self.handlers,
                self.bans,
                decisions.prepare(context),
                lambda op, key: decisions.answer(op, context, key),
            )
        return found

    # --------------------------------------------------------------------- regions

    def enter(self) -> list[Any]:
        """Start a region (the forward pre-hook of a wrapped model calls this): autocast,
        and this plan's region; returns what :meth:`exit` closes."""
        contexts: list[Any] = []
        try:
            if self.autocast is not None:
                for device_type in self.device_types:
                    ctx = torch.autocast(device_type, dtype=self.autocast)
                    ctx.__enter__()
                    contexts.append(ctx)
        except BaseException:
            for ctx in reversed(contexts):
                ctx.__exit__(None, None, None)
            raise
        push(self.regions[None])
        return contexts

    def exit(self, contexts: list[Any]) -> None:
        """End the region :meth:`enter` started (the post-hook calls this, even on errors)."""
        pop()
        for ctx in reversed(contexts):
            ctx.__exit__(None, None, None)


@contextmanager
def region(casting: OpCasting) -> Iterator[None]:
    """Run a block as a wrapped model's forward would run (used by tests and conformance;
    the plan's kernels must be installed: :func:`mixprec_torch.o1.autocast_kernels.install`)."""
    contexts = casting.enter()
    try:
        yield
    finally:
        casting.exit(contexts)
