"""Diagnostics beyond loss-scale events: per-module dtypes, overflowing parameters, underflow.

Framework-neutral records and their text form; the backends fill them in
(``mixprec.torch.dtype_report(model)``, ``mixprec.torch.overflowing_params(optimizer)``,
``mixprec.torch.underflow_fraction(model)`` and the same names in ``mixprec.mxnet``).

- :class:`ModuleDtypes` is one row of a dtype report: a module, the dtype of its own
  parameters, the dtype it computes in, and why (the module rule that pins it, the pinned
  module it sits in, or the policy's ``param``). :func:`dtype_rows` works the reasons out
  from a policy, so every backend explains a dtype the same way.
- :class:`OverflowRecord` names the parameters whose gradients were inf or NaN on one
  skipped step. Backends compute it only when a step is skipped.
- :func:`underflow_threshold` is the smallest normal number of a dtype: a true gradient
  below it loses precision (or flushes to zero) when stored in that dtype unscaled.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from mixprec.dtypes import format_info
from mixprec.policy.precedence import module_rule
from mixprec.policy.value import Policy

__all__ = [
    "ModuleDtypes",
    "OverflowRecord",
    "dtype_rows",
    "format_dtype_report",
    "format_underflow",
    "pinning_rule",
    "underflow_threshold",
]

ROOT = "(root)"


@dataclass(frozen=True, slots=True)
class ModuleDtypes:
    """One module of a dtype report.

    ``path`` is the module's qualified name (``""`` for the root), ``class_name`` its class,
    ``param_dtype`` the dtype of its own parameters (``"-"`` when it has none),
    ``compute`` the dtype its ops run in unless op rules say otherwise, and ``rule`` why:
    ``"pinned by class rule *BatchNorm*"``, ``"inherited from 'encoder'"``,
    ``"policy param=float16"`` (``"policy param=bfloat16, master=kahan"`` under a
    compensated strategy, with ``", state=bfloat16"`` when the optimizer state is kept in
    bfloat16), or a backend's own reason.
    """

    path: str
    class_name: str
    param_dtype: str
    compute: str
    rule: str


@dataclass(frozen=True, slots=True)
class OverflowRecord:
    """The parameters whose gradients held an inf or NaN on the skipped step ``step``.

    ``params`` is empty when the overflow happened only on other ranks.
    """

    step: int
    params: tuple[str, ...]

    def __str__(self) -> str:
        names = ", ".join(self.params) if self.params else "none on this rank"
        return f"step {self.step}: non-finite gradients in {names}"


def pinning_rule(policy: Policy, path: str, classes: Sequence[str]) -> str | None:
    """``"pinned by <kind> rule <pattern>"`` for the module rule that pins this module's dtype
    (:func:`mixprec.policy.precedence.module_rule` decides, as for
    :meth:`Policy.module_dtype`), or None.

    :raises PolicyError: matching rules of the deciding kind pin different dtypes."""
    found = module_rule(policy.modules, path, tuple(classes), lambda rule: rule.dtype)
    return None if found is None else f"pinned by {found[0].match} rule {found[0].pattern}"


def dtype_rows(
    policy: Policy,
    modules: Iterable[tuple[str, Sequence[str], str]],
    reasons: Mapping[str, tuple[str, str]] | None = None,
) -> list[ModuleDtypes]:
    """The report rows for ``modules``: ``(path, class names, own param dtype)``, parents first.

    :param reasons: ``path -> (compute dtype, reason)`` for modules a backend treats
        specially (say, a kernel that needs float32 parameters); they win over the policy.
    """
    reasons = reasons or {}
    decided: dict[str, tuple[str, str, bool]] = {}  # path -> (compute, rule, set by a pin)
    rows = []
    for path, classes, param_dtype in modules:
        pin = policy.module_dtype(path, classes)
        parent = _parent(path, decided)
        if path in reasons:
            compute, rule = reasons[path]
            pinned = True
        elif pin is not None:
            compute, rule, pinned = pin, pinning_rule(policy, path, classes) or "pinned", True
        elif parent is not None and decided[parent][2]:
            compute, pinned = decided[parent][0], True
            origin = decided[parent][1]
            where = repr(parent) if parent else "the root"
            rule = origin if origin.startswith("inherited") else f"inherited from {where}"
        else:
            compute, rule, pinned = policy.compute, _policy_reason(policy), False
        decided[path] = (compute, rule, pinned)
        name = classes[0] if classes else "?"
        rows.append(ModuleDtypes(path, name, param_dtype, compute, rule))
    return rows


def _policy_reason(policy: Policy) -> str:
    # a compensated strategy changes what the params hold, so the report says so
    if policy.master_strategy is not None:
        state = "" if policy.state is None else f", state={policy.state}"
        return f"policy param={policy.param}, master={policy.master_strategy}{state}"
    return f"policy param={policy.param}"


def _parent(path: str, decided: Mapping[str, object]) -> str | None:
    """The nearest decided ancestor of ``path`` (``""`` is the root), or None for the root."""
    if path == "":
        return None
    while "." in path:
        path = path.rpartition(".")[0]
        if path in decided:
            return path
    return "" if "" in decided else None


def format_dtype_report(rows: Iterable[ModuleDtypes]) -> str:
    """A printable table: module path, class, param dtype, compute dtype and why."""
    table = [("module", "class", "params", "compute", "why")]
    table += [(r.path or ROOT, r.class_name, r.param_dtype, r.compute, r.rule) for r in rows]
    if len(table) == 1:
        return "no modules to report"
    return _table(table)


def underflow_threshold(dtype: object) -> float:
    """The smallest normal number of ``dtype``: smaller magnitudes lose precision in it."""
    return format_info(dtype).smallest_normal


def format_underflow(fractions: Mapping[str, float], dtype: object | None = None) -> str:
    """A printable table of ``parameter -> fraction of nonzero gradients below the threshold``."""
    if not fractions:
        return "no gradients to report"
    below = f"below {underflow_threshold(dtype):.3g}" if dtype is not None else "underflow"
    table = [("parameter", below)]
    table += [(name, f"{frac:.1%}") for name, frac in fractions.items()]
    return _table(table)


def _table(rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
