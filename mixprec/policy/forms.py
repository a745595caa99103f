"""A policy's text forms: the short ``str()`` form and the mapping (dict, TOML) reader.

Both work on any policy value through :class:`mixprec.policy.presets.PolicyFields` and sit
below :mod:`mixprec.policy.value` in the policy wing, so :class:`~mixprec.policy.value.Policy`
prints and reads itself without an import circle:

- :func:`format_policy` is ``str(policy)``: the built-in preset's name when the policy
  equals one, else the shortest key-grammar spec relative to a built-in base
  (``"base=O1,path:big=float32"``); ``mixprec.get_policy(str(p)) == p`` always.
- :func:`policy_from_mapping` reads the :meth:`~mixprec.policy.value.Policy.to_dict` form, or a
  partial one on a ``base`` preset; the caller says where presets come from
  (:meth:`Policy.from_dict <mixprec.policy.value.Policy.from_dict>`: the built-in ones;
  :func:`mixprec.get_policy`: plugin presets too).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from typing import Any

from mixprec.errors import PolicyError
from mixprec.policy.grammar import (
    check_policy_mapping,
    format_loss_scale,
    loss_scale_from_value,
    parse_module_rule,
)
from mixprec.policy.presets import (
    BUILTIN_PRESETS,
    ROLE_FIELDS,
    P,
    PolicyFields,
    derive,
    preset_like,
    preset_name_of,
)
from mixprec.policy.rules import LIST_NAMES, ModuleRule, OpRules, with_rule

__all__ = ["MAPPING_KEYS", "ROLE_KEYS", "format_policy", "parsed_roles", "policy_from_mapping"]

#: The role keys a spec or mapping may give (``params`` is accepted for ``param``).
ROLE_KEYS: tuple[str, ...] = ("params", *ROLE_FIELDS)


def parsed_roles(roles: Mapping[str, Any]) -> dict[str, Any]:
    """``roles`` with a ``loss_scale`` in any form a spec may hold (a string in the key
    grammar, a number, a mapping) read into a loss-scale object, for
    :func:`mixprec.policy.presets.derive`."""
    out = dict(roles)
    if "loss_scale" in out:
        out["loss_scale"] = loss_scale_from_value(out["loss_scale"])
    return out


# ---------------------------------------------------------------------- the short str() form


def _op_items(start: OpRules, goal: OpRules) -> list[str]:
    # A list that lost an op to no list at all must be set exactly ("fp32=..."); any other
    # change is a move ("fp32+=..."). Exact sets go first: a later move only takes ops the
    # goal puts elsewhere, so it never undoes them.
    exact, moves = [], []
    for name in LIST_NAMES:
        have, want = getattr(start, name), getattr(goal, name)
        if any(goal.list_of(op) is None for op in have - want):
            exact.append(f"{name}={'|'.join(sorted(want))}")
        elif want - have:
            moves.append(f"{name}+={'|'.join(sorted(want - have))}")
    return exact + moves


def _module_items(start: tuple[ModuleRule, ...], goal: tuple[ModuleRule, ...]) -> list[str]:
    rules, items = start, []
    for rule in goal:
        if rule not in rules:
            rules = with_rule(rules, rule)
            items.append(str(rule))
    if rules == goal:
        return items
    return ["modules=none", *(str(rule) for rule in goal)]


def _format_from(policy: PolicyFields, base_name: str) -> str:
    base = preset_like(policy, base_name)
    over: dict[str, Any] = {}
    if policy.compute != base.compute:
        over["compute"] = policy.compute
    start = derive(base, over)
    for role in ("param", "output", "master", "reduce", "state", "fp8"):
        if getattr(policy, role) != getattr(start, role):
            over[role] = getattr(policy, role)
    start = derive(base, over)
    if policy.loss_scale != start.loss_scale:
        over["loss_scale"] = policy.loss_scale
        start = derive(base, over)
    items = [f"base={base_name}"]
    for key, value in over.items():
        if key == "loss_scale":
            value = format_loss_scale(value)
        items.append(f"{key}={'none' if value is None else value}")
    items += _op_items(start.ops, policy.ops)
    items += _module_items(start.modules, policy.modules)
    return ",".join(items)


def format_policy(policy: PolicyFields) -> str:
    """The preset name if ``policy`` equals a built-in one, else the shortest key-grammar spec."""
    name = preset_name_of(policy)
    if name is not None:
        return name
    specs = []
    for base in BUILTIN_PRESETS:
        try:
            specs.append(_format_from(policy, base))
        except PolicyError:  # a compute change on this base alone is contradictory (O2 to
            continue  # float32: a pointless master); O0 always works as a base
    return min(specs, key=len)


# ---------------------------------------------------------------------- mappings (dict, TOML)

#: Every key a policy mapping may have.
MAPPING_KEYS: tuple[str, ...] = (
    "base",
    "name",
    *ROLE_KEYS,
    "ops",
    "move_ops",
    "modules",
    "add_modules",
)


def _rule_from_mapping(d: Any) -> ModuleRule:
    if isinstance(d, ModuleRule):
        return d
    if isinstance(d, str):  # "class:*BatchNorm*=float32"
        key, _, value = d.partition("=")
        return parse_module_rule(key, value)
    if not isinstance(d, Mapping) or set(d) - {"match", "pattern", "dtype", "ops"}:
        raise PolicyError(
            f"bad module rule {d!r}; give a table with keys match ('class' or 'path'), "
            "pattern, dtype and/or ops (a table of op = list)"
        )
    dtype = d.get("dtype")
    dtype = None if dtype is None or str(dtype).lower() == "none" else dtype
    return ModuleRule(d.get("match", "class"), d.get("pattern", ""), dtype, d.get("ops") or ())


def _lists(d: Any, key: str) -> dict[str, Any]:
    if not isinstance(d, Mapping):
        raise PolicyError(f"{key!r} must map op lists to op names, e.g. {{'fp32': ['softmax']}}")
    return dict(d)


def policy_from_mapping(d: Mapping[str, Any], preset: Callable[[str], P]) -> P:
    """A policy from a mapping (the :meth:`~mixprec.policy.value.Policy.to_dict` form, or a
    partial one), built on ``preset(d.get("base", "auto"))``.

    Keys: ``base`` (a preset to start from; ``"auto"`` if absent), ``name`` (display only),
    the role fields, ``ops`` (lists set exactly: ``{"fp32": ["softmax"]}`` makes the fp32
    list just softmax), ``move_ops`` (ops moved into lists, like
    :meth:`~mixprec.policy.value.Policy.with_ops`), ``modules`` (the complete list of module
    rules) and ``add_modules`` (rules added to the base's, or replacing the base's rule for
    the same pattern).

    :param preset: the preset a name stands for (raising :class:`PolicyError` for an
        unknown one).
    :raises PolicyError: a value of the wrong shape (checked first, whole:
        :func:`mixprec.policy.grammar.check_policy_mapping`), an unknown key, preset or value.
    """
    check_policy_mapping(d)
    unknown = sorted(set(d) - set(MAPPING_KEYS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], MAPPING_KEYS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise PolicyError(
            f"unknown policy keys {unknown}.{hint} Valid keys: {', '.join(MAPPING_KEYS)}"
        )
    roles = parsed_roles({k: d[k] for k in ROLE_KEYS if k in d})
    policy = derive(preset(d.get("base", "auto")), roles)
    ops = policy.ops
    if "ops" in d:
        ops = ops.replaced(**_lists(d["ops"], "ops"))
    if "move_ops" in d:
        ops = ops.edited(**_lists(d["move_ops"], "move_ops"))
    modules = policy.modules
    if "modules" in d:
        modules = tuple(_rule_from_mapping(rule) for rule in d["modules"])
    for rule in d.get("add_modules", ()):
        modules = with_rule(modules, _rule_from_mapping(rule))
    return dataclasses.replace(policy, ops=ops, modules=modules, name=d.get("name"))
