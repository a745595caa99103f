"""Diagnostics for wrapped models and optimizers: dtype report, overflow names, underflow.

- :func:`dtype_report` prints each module's parameter dtype and the rule that chose it,
  from the plan ``wrap`` stored on the model.
- :func:`overflowing_params` names the parameters whose gradients were inf or NaN on the
  latest skipped step. The names are found by :func:`record_overflows`, which the step
  calls only when the overflow check fired (before the scaler hears of it, so a
  ``mixprec_step_skipped`` hook or an event subscriber can already ask): one extra pass
  over the gradients on a skipped step, nothing on a normal one.
- :func:`underflow_fraction` measures, on demand, how much of each gradient is too small for
  a dtype: call it between the backward pass and ``step()`` (or after ``unscale_``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mixprec.errors import WrapError
from mixprec.kit import (
    NORM_LIMIT,
    ModuleDtypes,
    OverflowRecord,
    dtype_rows,
    format_dtype_report,
    underflow_threshold,
)

from ..dtypes import dtype_name
from ..torch_private import compiled_inner, sparse_values
from .optimizer_state import OptimizerState, WrapGroup, optimizer_state

FLOAT32_MAX = NORM_LIMIT * NORM_LIMIT

__all__ = [
    "dtype_report",
    "module_dtypes",
    "overflowing_params",
    "record_overflows",
    "underflow_fraction",
]


def _record(model: Any, what: str) -> Any:
    """The ``ModelRecord`` wrap attached to ``model`` (looking through DDP and compile)."""
    inner = model
    if getattr(inner, "_mixprec", None) is None:
        inner = compiled_inner(inner) or inner
    if getattr(inner, "_mixprec", None) is None and isinstance(
        getattr(inner, "module", None), nn.Module
    ):
        inner = inner.module
    record = getattr(inner, "_mixprec", None)
    if record is None or not hasattr(record, "casting"):
        raise WrapError(
            f"{what} needs a model wrapped by mixprec.torch.wrap, got {type(model).__name__}; "
            "wrap it first: model, optimizer = mixprec.torch.wrap(model, optimizer, policy=...)"
        )
    return record


def _own_dtype(module: nn.Module) -> str:
    dtypes = sorted(
        {dtype_name(p.dtype) for p in module.parameters(recurse=False) if p.is_floating_point()}
    )
    return "/".join(dtypes) if dtypes else "-"


def module_dtypes(model: nn.Module, *, every_module: bool = False) -> list[ModuleDtypes]:
    """The rows of :func:`dtype_report`: modules with parameters of their own or a module rule
    (every module with ``every_module=True``), parents first."""
    record = _record(model, "module_dtypes")
    sites = record.casting.sites
    policy = record.policy
    rows = dtype_rows(policy, ((s.name, s.classes, _own_dtype(s.module)) for s in sites))
    return [
        row
        for row, site in zip(rows, sites, strict=True)
        if every_module or row.param_dtype != "-" or site.has_rule
    ]


def dtype_report(model: nn.Module, *, every_module: bool = False) -> str:
    """A printable table of each module's parameter dtype, compute dtype and why.

    >>> print(mixprec.torch.dtype_report(model))  # doctest: +SKIP
    module  class        params    compute  why
    ------  -----------  --------  -------  --------------------------------
    0       Linear       bfloat16  bfloat16 policy param=bfloat16
    1       BatchNorm1d  float32   float32  pinned by class rule *BatchNorm*
    """
    return format_dtype_report(module_dtypes(model, every_module=every_module))


# ---------------------------------------------------------------------- overflow


def _names_of_masters(group: WrapGroup) -> dict[int, str]:
    """id(tensor the optimizer holds) -> the model parameter's name."""
    return {id(master): group.names[id(param)] for param, master in group.masters.pairs}


def record_overflows(
    step: int, members: Sequence[tuple[OptimizerState, torch.optim.Optimizer]]
) -> tuple[str, ...]:
    """Record, for each optimizer of a skipped step, the parameters whose gradients overflowed:
    an inf or NaN, or a squared norm beyond float32's range (when only the sum over several
    parameters overflows, the one with the largest norm is named). Returns every name found.

    Called by the step only when the overflow check fired; the gradients are already
    unscaled, which keeps an inf an inf and a NaN a NaN.
    """
    names: dict[int, str] | None = None
    every: dict[str, None] = {}
    for st, opt in members:
        if names is None:
            names = _names_of_masters(st.group)
        labels: list[str] = []
        flags: list[torch.Tensor] = []
        with torch.no_grad():
            for group in opt.param_groups:
                for param in group["params"]:
                    grad = _local_grad(st, param.grad)
                    if grad is None:
                        continue
                    labels.append(names.get(id(param), f"<unnamed {list(param.shape)}>"))
                    flags.append(torch.linalg.vector_norm(grad, dtype=torch.float32).square())
            squares = torch.stack([f.to(flags[0].device) for f in flags]).tolist() if flags else []
        found = tuple(
            dict.fromkeys(n for n, sq in zip(labels, squares, strict=True) if not math.isfinite(sq))
        )
        if not found and squares and sum(squares) > FLOAT32_MAX:  # only the sum overflowed
            found = (labels[max(range(len(squares)), key=squares.__getitem__)],)
        every.update(dict.fromkeys(found))
        st.overflows.append(OverflowRecord(step, found))
    return tuple(every)


def overflowing_params(optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of the parameters whose gradients were inf or NaN on the latest skipped step.

    Empty before the first skip (and on a rank where only other ranks overflowed). The
    names are the model's ``named_parameters()`` names (``model<i>.`` prefixed when ``wrap``
    got several models); the last 100 skips are kept as
    :class:`mixprec.OverflowRecord` s in ``overflow_records(optimizer)``.
    """
    records = optimizer_state(optimizer, "overflowing_params").overflows
    return list(records[-1].params) if records else []


def overflow_records(optimizer: torch.optim.Optimizer) -> list[OverflowRecord]:
    """The :class:`mixprec.OverflowRecord` of each of the last 100 skipped steps, oldest first."""
    return list(optimizer_state(optimizer, "overflow_records").overflows)


# ---------------------------------------------------------------------- underflow


def _local_grad(st: OptimizerState | None, grad: torch.Tensor | None) -> torch.Tensor | None:
    if grad is None:
        return None
    if st is not None and st.local is not None:
        grad = st.local(grad)
    if grad.is_sparse:
        grad = sparse_values(grad)
    return grad


def underflow_fraction(model_or_optimizer: Any, dtype: str = "float16") -> dict[str, float]:
    """For each parameter with a gradient: the fraction of its nonzero gradient elements whose
    true (unscaled) magnitude is below ``dtype``'s smallest normal number.

    A high fraction for ``float16`` means those gradients would lose precision or flush to
    zero without loss scaling. Pass a wrapped model (its parameters) or optimizer (the
    parameters it updates). Before ``step()`` the model's scaled gradients are divided by
    the loss scale; after ``unscale_`` or ``step()`` the optimizer's unscaled gradients are
    read. Costs one pass over the gradients and one host sync: not for every step.
    """
    threshold = underflow_threshold(dtype)
    if isinstance(model_or_optimizer, nn.Module):
        record = _record(model_or_optimizer, "underflow_fraction")
        group: WrapGroup = record.group
        wanted = {id(p) for p in model_or_optimizer.parameters()}
    else:
        group = optimizer_state(model_or_optimizer, "underflow_fraction").group
        held = {id(p) for g in model_or_optimizer.param_groups for p in g["params"]}
        wanted = {id(p) for p, master in group.masters.pairs if id(master) in held}
    owners: dict[int, OptimizerState] = {}
    for live in group.live_states():
        opt = live.optimizer()
        if opt is not None:
            for g in opt.param_groups:
                owners.update({id(p): live for p in g["params"]})
    scaler = group.scaler
    names: list[str] = []
    ratios: list[torch.Tensor] = []
    with torch.no_grad():
        for param, master in group.masters.pairs:
            if id(param) not in wanted:
                continue
            name = group.names[id(param)]
            st = owners.get(id(master))
            pending = st is not None and st.tracker.needs_unscale
            grad, divisor = master.grad, 1.0
            if pending or grad is None:
                grad = param.grad
                divisor = scaler.scale if pending and scaler.enabled else 1.0
            grad = _local_grad(st, grad)
            if grad is None:
                continue
            magnitude = grad.detach().float().abs()
            nonzero = magnitude != 0
            small = nonzero & (magnitude < threshold * divisor)
            ratios.append(small.sum() / nonzero.sum().clamp(min=1))
            names.append(name)
        values = torch.stack([r.to(ratios[0].device) for r in ratios]).tolist() if ratios else []
    return dict(zip(names, values, strict=True))
