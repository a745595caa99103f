"""Step-time collectives: every rank skipping together.

The one rule
    An overflow on *any* rank must skip the step on *every* rank, or the replicas drift
    apart. :func:`all_reduce_found_inf` makes the per-rank ``found_inf`` flag global (one
    MAX all-reduce of a one-element tensor per step); the optimizer step calls it right after
    unscaling, before it decides to skip, whenever ``torch.distributed`` is initialised.
    Under DDP the gradients are already averaged, so an inf usually reaches every rank anyway;
    the reduction makes the decision identical even when it does not (an inf produced after
    the all-reduce, a ``no_sync`` step). Under FSDP2 it is essential: after the
    reduce-scatter each rank sees only its own gradient shard.

**A bounded wait.** A rank that fails but stays alive (an exception caught by the training
script, a hang in data loading) would leave its peers blocked in this all-reduce until the
process group's timeout (30 minutes by default) with only the collective library's generic
message. The all-reduce is therefore asynchronous and waited for at most
:func:`overflow_timeout` seconds (``MIXPREC_OVERFLOW_TIMEOUT``, default 300, or
:func:`set_overflow_timeout`); then :class:`~mixprec.errors.DistributedError` names the
overflow check, the step and what to look for.

**Where the consensus runs.** The flag is reduced over the group that reduces the model's
gradients, nowhere else (:func:`consensus_group`): ``wrap(..., process_group=...)`` when given
(``"local"``: a model only this rank trains, no collective at all), else the process group of
the DDP that ran the model's forward (recorded by a forward pre-hook until the first step), else
the FSDP2 mesh of its sharded parameters (1-D meshes), else the default group (WORLD).

**Only the wait for this all-reduce is bounded here.** DDP's gradient all-reduce and FSDP's
collectives run inside backward and forward, under the process group's own timeout: create the
group with :func:`process_group_timeout` (``init_process_group(..., timeout=...)``) so those
waits end after the same ``MIXPREC_OVERFLOW_TIMEOUT``.

**The first step checks the model.** At each optimizer's first ``step()``
(:func:`check_first_step`) the wrapped models' parameters must still be the ones ``wrap``
converted: ``fully_shard`` or ``FullyShardedDataParallel`` applied *after* ``wrap`` replaces them,
and the optimizer would step masters the model no longer uses (training that does nothing).

The wrap-time recipes (DDP's reduce hook, FSDP2's ``fully_shard`` under a policy) live in
:mod:`mixprec_torch.wrapping.sharding`.
"""

from __future__ import annotations

import datetime
import os
import weakref
from typing import Any

import torch

from mixprec.errors import DistributedError, PolicyError, WrapError

from ..torch_private import active_ddp_module

__all__ = [
    "LOCAL",
    "Consensus",
    "all_reduce_found_inf",
    "check_first_step",
    "check_process_group",
    "consensus_group",
    "is_distributed",
    "overflow_timeout",
    "process_group_timeout",
    "set_overflow_timeout",
]

LOCAL = "local"
"""``wrap(..., process_group="local")``: the model is trained on this rank only (a probe, a
teacher, an evaluator); its steps join no collective."""

ENV_TIMEOUT = "MIXPREC_OVERFLOW_TIMEOUT"
DEFAULT_TIMEOUT = 300.0
_timeout: float | None = None  # set_overflow_timeout's value; None: the environment decides


def set_overflow_timeout(seconds: float | None) -> None:
    """Wait at most ``seconds`` for the other ranks in the per-step overflow all-reduce
    (None: back to ``MIXPREC_OVERFLOW_TIMEOUT`` or the default, 300 s)."""
    global _timeout
    if seconds is not None:
        _check_timeout(seconds, "set_overflow_timeout")
    _timeout = None if seconds is None else float(seconds)


def overflow_timeout() -> float:
    """Seconds the per-step overflow all-reduce waits for the other ranks."""
    if _timeout is not None:
        return _timeout
    raw = os.environ.get(ENV_TIMEOUT)
    if raw is None or not raw.strip():
        return DEFAULT_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    return _check_timeout(seconds, ENV_TIMEOUT)


def _check_timeout(seconds: float, source: str) -> float:
    if not seconds > 0 or seconds == float("inf"):
        raise PolicyError(
            f"{source} must be a positive, finite number of seconds, got {seconds!r}; "
            f"the default is {DEFAULT_TIMEOUT:g}"
        )
    return float(seconds)


def process_group_timeout() -> datetime.timedelta:
    """:func:`overflow_timeout` as the ``timeout`` of ``torch.distributed.init_process_group``
    (or ``new_group``): DDP's gradient all-reduce and FSDP's collectives then give up after the
    same number of seconds as mixprec's overflow check (gloo raises; NCCL needs its async
    error handling, on by default)."""
    return datetime.timedelta(seconds=overflow_timeout())


def is_distributed(group: Any | None = None) -> bool:
    """True when ``torch.distributed`` is initialised here and ``group`` has several ranks
    (never for :data:`LOCAL`)."""
    if isinstance(group, str):  # LOCAL
        return False
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return False
    return bool(torch.distributed.get_world_size(group) > 1)


# --------------------------------------------------------------------------------------------
# where the consensus runs, and the first step's check of the models


def check_process_group(process_group: Any) -> Any:
    """Check ``wrap``'s ``process_group`` argument (before anything changes)."""
    if process_group is None or process_group == LOCAL:
        return process_group
    if isinstance(process_group, str) or not (
        torch.distributed.is_available()
        and isinstance(process_group, torch.distributed.ProcessGroup)
    ):
        raise WrapError(
            f"process_group={process_group!r}: pass a torch.distributed.ProcessGroup (the one "
            "the model's gradients are reduced over, e.g. DDP's process_group), 'local' for a "
            "model only this rank trains (no collective at all), or None (default: the group of "
            "the model's DDP/FSDP wrapper, else the default group)"
        )
    return process_group


class Consensus:
    """One ``wrap`` call's process group for the overflow consensus, and what finds it.

    :param models: the wrapped models (held weakly).
    :param requested: ``wrap``'s ``process_group``: a group, :data:`LOCAL`, or None (find it).
    """

    def __init__(self, models: list[torch.nn.Module], requested: Any) -> None:
        self.models = [weakref.ref(m) for m in models]
        self.requested = requested
        self.found: Any = None
        """The process group of the DDP that ran a model's forward (None: none seen yet)."""
        self.resolved = requested is not None
        self.hooks: list[Any] = []
        if requested is None:
            self.hooks = [m.register_forward_pre_hook(self._record) for m in models]

    def __deepcopy__(self, memo: dict[int, Any]) -> Consensus:
        # a copied model's hook still points here: a copy's group has no optimizer steps
        return self

    def _record(self, module: torch.nn.Module, args: Any) -> None:
        """Forward pre-hook until the first step: the DDP running this forward, if any."""
        if self.found is None and not torch.compiler.is_compiling():
            ddp = active_ddp_module()
            if ddp is not None:
                self.found = getattr(ddp, "process_group", None)

    def group(self) -> Any:
        """The group the overflow flag is reduced over (None: the default group)."""
        if self.resolved:
            return self.requested if self.requested is not None else self.found
        return self.found

    def resolve(self) -> None:
        """Fix the group at the first step; the forward hooks go."""
        if self.resolved:
            return
        if self.found is None:
            self.found = _mesh_group(self.models)
        self.requested = self.found
        self.resolved = True
        for handle in self.hooks:
            handle.remove()
        self.hooks = []


_CONSENSUS: weakref.WeakKeyDictionary[Any, Consensus] = weakref.WeakKeyDictionary()


def register_consensus(wrap_group: Any, models: list[torch.nn.Module], requested: Any) -> None:
    """Record where ``wrap_group`` (a ``WrapGroup``) reduces its overflow flag."""
    _CONSENSUS[wrap_group] = Consensus(models, requested)


def consensus_group(wrap_group: Any) -> Any:
    """The process group ``wrap_group``'s overflow flag is reduced over: a group, None (the
    default group) or :data:`LOCAL`."""
    if wrap_group is None:
        return None
    consensus = _CONSENSUS.get(wrap_group)
    return None if consensus is None else consensus.group()


def _mesh_group(models: list[weakref.ReferenceType[torch.nn.Module]]) -> Any:
    """The process group of a 1-D FSDP2 mesh the models' parameters are sharded over."""
    for ref in models:
        model = ref()
        for param in () if model is None else model.parameters():
            mesh = getattr(param, "device_mesh", None)
            if mesh is not None:
                return mesh.get_group() if mesh.ndim == 1 else None
    return None


def check_first_step(st: Any, optimizer: torch.optim.Optimizer) -> None:
    """At an optimizer's first ``step()``: refuse models whose parameters were replaced since
    ``wrap`` (FSDP applied after it), and fix the consensus group. Changes nothing on refusal.
    Sets ``st.models_checked`` once it passed (the step calls this only until then).

    Runs eagerly (a graph break at a compiled first step, none after): dynamo tracing the
    weak containers below failed at random with an IndexError inside dynamo.

    :raises WrapError: naming the replaced parameters and the recipe that works.
    """
    consensus = _CONSENSUS.get(st.group)
    if consensus is None:
        st.models_checked = True
        return
    group = st.group
    replaced: list[str] = []
    for index, ref in enumerate(consensus.models):
        model = ref()
        if model is None:
            continue
        current = {id(p) for p in model.parameters()}
        replaced += [
            group.names.get(pid, "?")
            for pid, owner in group.param_models.items()
            if owner == index and pid not in current
        ]
    by_master = {id(m): p for p, m in group.masters.copied_pairs()}
    replaced += [  # FSDP1 with use_orig_params keeps the objects, as flat shards
        group.names.get(id(param), "?")
        for pg in optimizer.param_groups
        for master in pg["params"]
        if (param := by_master.get(id(master))) is not None and param.shape != master.shape
    ]
    if replaced:
        shown = ", ".join(replaced[:4]) + (
            f" and {len(replaced) - 4} more" if len(replaced) > 4 else ""
        )
        raise WrapError(
            f"the wrapped model's parameters are no longer the ones mixprec.torch.wrap converted "
            f"({shown} replaced): FSDP's fully_shard or FullyShardedDataParallel was applied "
            "after wrap, or a parameter was re-assigned, so the optimizer would step masters "
            "the model no longer uses and training would change nothing. Nothing was stepped. "
            "Shard first, then build the optimizer, then wrap: "
            "mixprec.torch.fully_shard_with_policy(model, policy); optimizer = "
            "torch.optim.AdamW(model.parameters()); model, optimizer = "
            "mixprec.torch.wrap(model, optimizer, policy). FSDP1 (FullyShardedDataParallel) "
            "is not supported: use FSDP2's fully_shard"
        )
    consensus.resolve()
    st.models_checked = True


check_first_step = torch.compiler.disable(
    check_first_step, reason="mixprec: the first step's one-time check of the models runs eagerly"
)


def all_reduce_found_inf(
    found_inf: torch.Tensor,
    group: Any | None = None,
    *,
    step: int | None = None,
    timeout: float | None = None,
) -> torch.Tensor:
    """Make ``found_inf`` global: all-reduce it with MAX across ``group``, in place.

    ``found_inf`` is the float, one-element flag the unscale wrote (``1.0`` when a gradient
    on this rank was inf or NaN). After the call every rank holds the same value, so every
    rank takes the same skip decision. One collective per step.

    The wait is bounded: after ``timeout`` seconds (default :func:`overflow_timeout`) without
    every rank's answer, :class:`~mixprec.errors.DistributedError` names the overflow check,
    ``step`` (the scaler's step count, for the message) and what to look for.

    Without ``torch.distributed``, before ``init_process_group``, or with a single rank,
    the tensor is returned unchanged. ``group`` defaults to the default process group;
    :data:`LOCAL` makes no collective call.
    """
    if not is_distributed(group):
        return found_inf
    seconds = overflow_timeout() if timeout is None else _check_timeout(timeout, "timeout")
    work = torch.distributed.all_reduce(
        found_inf, op=torch.distributed.ReduceOp.MAX, group=group, async_op=True
    )
    try:
        work.wait(timeout=datetime.timedelta(seconds=seconds))
    except RuntimeError as err:  # gloo/NCCL time-outs and peer failures (DistBackendError)
        world = torch.distributed.get_world_size(group)
        rank = torch.distributed.get_rank()
        at = f"step {step}" if step is not None else "this step"
        raise DistributedError(
            f"mixprec's per-step overflow check (the found_inf all-reduce every rank joins "
            f"in optimizer.step()) failed on rank {rank} of {world} at {at} after waiting up "
            f"to {seconds:g} s: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
            ". Another rank has probably failed while staying alive, or hangs: look in the "
            "other ranks' logs for an exception (caught and ignored?), a rank that skipped "
            "optimizer.step() or runs a different number of steps, or one stuck in data "
            f"loading. To wait longer set {ENV_TIMEOUT} (seconds) or "
            "mixprec_torch.step.distributed.set_overflow_timeout()"
        ) from err
    return found_inf
