"""Diagnostics for a mixprec Trainer: dtype report, overflow names, underflow fractions.

The same names as :mod:`mixprec_torch.diagnostics`, taking the trainer (or, for the dtype
report, the net the trainer converted):

- :func:`dtype_report` prints each block's parameter dtype and the rule that chose it;
- :func:`overflowing_params` names the parameters whose gradients were inf or NaN on the
  latest skipped step. :func:`~mixprec_mxnet.step.protocol.record_overflows` finds them (part of
  the step: it runs only when the overflow check fired, before the scaler's hooks run);
- :func:`underflow_fraction` measures, on demand, how much of each gradient is too small for
  a dtype. Call it between the backward pass and ``step()`` (or after ``unscale()``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

from mxnet import gluon, nd

from mixprec.errors import WrapError
from mixprec.kit import (
    BFLOAT16,
    FLOAT32,
    ModuleDtypes,
    OverflowRecord,
    Policy,
    Stage,
    dtype_rows,
    format_dtype_report,
    is_low_precision,
    underflow_threshold,
)

from .dtypes import cast, dtype_name
from .gluon_private import own_params
from .ops import unsupported_natives
from .step import checkpoint
from .step.protocol import named_pairs, record_overflows
from .trainer import Trainer
from .wrapping.casting import BlockSite, needs_fp32_params, plan_net
from .wrapping.islands import block_natives
from .wrapping.masters import ensure_prepared
from .wrapping.symbol_blocks import FP32_PARAM_OPS, graph_ops

__all__ = [
    "dtype_report",
    "module_dtypes",
    "overflow_records",
    "overflowing_params",
    "record_overflows",
    "underflow_fraction",
]


def _trainer_of(net_or_trainer: Any, what: str) -> Trainer:
    if isinstance(net_or_trainer, Trainer):
        return net_or_trainer
    saver = getattr(net_or_trainer, "save_parameters", None)
    # the Trainer binds itself into the net's save_parameters when it converts the net
    if isinstance(saver, functools.partial) and saver.func is checkpoint.save_parameters:
        return saver.args[0]  # type: ignore[no-any-return]
    raise WrapError(
        f"{what} needs a mixprec.mxnet.Trainer or the net one converted, got "
        f"{type(net_or_trainer).__name__}; build the trainer first: "
        "trainer = mixprec.mxnet.Trainer(net, optimizer, policy=...)"
    )


def _own_dtype(block: gluon.Block) -> str:
    dtypes = sorted({dtype_name(p.dtype) for p in own_params(block)})
    return "/".join(dtypes) if dtypes else "-"


def module_dtypes(net_or_trainer: Any, *, every_module: bool = False) -> list[ModuleDtypes]:
    """The rows of :func:`dtype_report`: blocks with parameters of their own or a module
    rule (every block with ``every_module=True``), parents first."""
    trainer = _trainer_of(net_or_trainer, "module_dtypes")
    net, policy = trainer._mixprec.net, trainer.policy
    if net is None:
        raise WrapError(
            "this Trainer was given parameters, not the net, so it has no blocks to report; "
            "pass the net itself: Trainer(net, ...)"
        )
    sites = plan_net(net, policy, trainer.device)
    reasons = {}
    for site in sites:
        info = site.info
        activations = policy.compute if policy.casts_ops else site.dtype
        islands = sorted(
            block_natives(info.classes) & unsupported_natives(activations, trainer.device)
        )
        if islands and is_low_precision(activations):
            ops = ", ".join(islands)
            reasons[info.path] = (FLOAT32, f"float32 island: no {activations} {ops} kernel here")
        elif needs_fp32_params(info) and is_low_precision(site.dtype):
            reasons[info.path] = (site.dtype, "float32 params: MXNet's BatchNorm kernel needs them")
        elif site.outside is not None and policy.module_dtype(info.path, info.classes) is None:
            reasons[info.path] = (site.dtype, f"{site.dtype} island: no {site.outside} kernel")
    modules: list[tuple[str, Sequence[str], str]] = []
    shown: list[bool] = []  # rows kept without every_module
    for site in sites:
        info = site.info
        modules.append((info.path, info.classes, _own_dtype(info.block)))
        shown.append(any(r.matches(info.path, info.classes) for r in policy.modules))
        if not policy.casts_ops and is_low_precision(site.dtype):
            for path, op, param_dtype, reason in _graph_rows(site, trainer.device):
                modules.append((path, (op,), param_dtype))
                reasons[path] = reason
                shown.append(True)
    rows = [_with_strategy(row, policy) for row in dtype_rows(policy, modules, reasons)]
    return [
        row
        for row, keep in zip(rows, shown, strict=True)
        if every_module or keep or row.param_dtype != "-"
    ]


def _with_strategy(row: ModuleDtypes, policy: Policy) -> ModuleDtypes:
    """``row`` saying, where its bfloat16 params are updated by a compensated strategy and
    its reason is a backend one (a float32 island), which strategy: the island changes
    where the op computes, not what the weights hold."""
    strategy = policy.master_strategy
    if strategy is None or row.param_dtype != BFLOAT16 or "master=" in row.rule:
        return row
    return dataclasses.replace(row, rule=f"{row.rule}; weights master={strategy}")


def _graph_rows(site: BlockSite, device: str) -> list[tuple[str, str, str, tuple[str, str]]]:
    """``(path, op, param dtype, (compute, why))`` for each op of an imported ``SymbolBlock``'s
    graph that runs as a float32 island or reads float32 parameters (it has no child blocks
    to report them by); the op's name follows the block's path, its op is its class."""
    params = {p.name: p for p in own_params(site.info.block)}
    missing = unsupported_natives(site.dtype, device)
    rows = []
    for node in graph_ops(site.info.block):
        path = f"{site.info.path}.{node.name}" if site.info.path else node.name
        dtypes = sorted({dtype_name(params[n].dtype) for n in node.params if n in params})
        param_dtype = "/".join(dtypes) if dtypes else "-"
        if node.op in missing:
            reason = (FLOAT32, f"float32 island: no {site.dtype} {node.op} kernel here")
        elif node.op in FP32_PARAM_OPS:
            reason = (site.dtype, "float32 params: MXNet's BatchNorm kernel needs them")
        else:
            continue
        rows.append((path, node.op, param_dtype, reason))
    return rows


def dtype_report(net_or_trainer: Any, *, every_module: bool = False) -> str:
    """A printable table of each block's parameter dtype, compute dtype and why."""
    return format_dtype_report(module_dtypes(net_or_trainer, every_module=every_module))


# ---------------------------------------------------------------------- overflow


def overflowing_params(trainer: Trainer) -> list[str]:
    """Names (``"0.weight"``, as ``net.save_parameters`` keys them) of the parameters whose
    gradients were inf or NaN on the latest skipped step; empty before the first skip."""
    records = _trainer_of(trainer, "overflowing_params")._mixprec.overflows
    return list(records[-1].params) if records else []


def overflow_records(trainer: Trainer) -> list[OverflowRecord]:
    """The :class:`mixprec.OverflowRecord` of each of the last 100 skipped steps, oldest first."""
    return list(_trainer_of(trainer, "overflow_records")._mixprec.overflows)


# ---------------------------------------------------------------------- underflow


def underflow_fraction(trainer: Trainer, dtype: str = "float16") -> dict[str, float]:
    """For each parameter with a gradient: the fraction of its nonzero gradient elements whose
    true (unscaled) magnitude is below ``dtype``'s smallest normal number.

    Before ``step()`` the model's scaled gradients (every context) are divided by the loss
    scale; after ``unscale()`` the unscaled master gradients are read. One pass over the
    gradients and one host sync: a diagnostic, not for every step.
    """
    trainer = _trainer_of(trainer, "underflow_fraction")
    threshold = underflow_threshold(dtype)
    unscaled = trainer._mixprec.tracker.stage is Stage.UNSCALED
    limit = (
        threshold if unscaled or not trainer.scaler.enabled else threshold * trainer.scaler.scale
    )
    names, small, nonzero = [], [], []
    ensure_prepared(trainer._mixprec, trainer)  # the masters exist from here on
    for name, param, master in named_pairs(trainer._mixprec):
        grads = master.list_grad() if unscaled else param.list_grad()
        magnitude = nd.concat(*[cast(g, FLOAT32).reshape((-1,)) for g in grads], dim=0).abs()
        names.append(name)
        small.append(((magnitude < limit) * (magnitude != 0)).sum())
        nonzero.append((magnitude != 0).sum())
    if not names:
        return {}
    small_n = nd.concat(*small, dim=0).asnumpy()
    nonzero_n = nd.concat(*nonzero, dim=0).asnumpy()
    return {
        name: float(s / n) if n else 0.0
        for name, s, n in zip(names, small_n, nonzero_n, strict=True)
    }
