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

The wrap-time recipes (DDP's reduce hook, FSDP2's ``fully_shard`` under a policy) live in
:mod:`mixprec_torch.wrapping.sharding`.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch

from mixprec.errors import DistributedError, PolicyError

__all__ = [
    "all_reduce_found_inf",
    "is_distributed",
    "overflow_timeout",
    "set_overflow_timeout",
]

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


def is_distributed(group: Any | None = None) -> bool:
    """True when ``torch.distributed`` is initialised here and ``group`` has several ranks."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return False
    return bool(torch.distributed.get_world_size(group) > 1)


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
    the tensor is returned unchanged. ``group`` defaults to the default process group.
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
