"""Policies as text and data: the key grammar both ways, mappings, and TOML.

The key grammar is comma-separated ``key=value`` items (jmp-style)::

    base=O1,compute=bfloat16,fp32+=matmul|bmm,class:*LayerNorm*=float32

Items apply in three phases, whatever order they are written in:

1. ``base`` (or a bare preset name as the first item) picks the starting preset, ``auto``
   if absent;
2. the role fields ``param``/``params``, ``compute``, ``output``, ``master`` (``none``
   for no masters), ``reduce`` and ``loss_scale`` apply together, as
   :func:`mixprec.presets.derive` does (it says what a changed compute re-derives);
3. op and module edits apply in the order written: ``fp32+=softmax|exp`` moves ops into a
   list, ``fp32=softmax|exp`` sets the list to exactly those ops;
   ``class:<glob>=...``/``path:<glob>=...`` adds a module rule or replaces the one for that
   pattern, and ``modules=none`` drops every rule.

Module rule values and loss scales are described in :mod:`mixprec.grammar`.
``str(policy)`` writes the preset name when the policy equals a built-in preset, else the
shortest spec relative to a built-in base; ``get_policy(str(p)) == p`` always.

Mappings (and so TOML files) use the keys of :func:`policy_from_mapping`.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mixprec.errors import PolicyError
from mixprec.grammar import (
    format_loss_scale,
    parse_module_rule,
    split_items,
    split_ops,
    toml_dumps,
)
from mixprec.policy import ModuleRule, OpRules, Policy
from mixprec.presets import BUILTIN_PRESETS, ROLE_FIELDS, derive, preset, preset_name_of
from mixprec.rules import LIST_NAMES, list_name, with_rule

__all__ = [
    "format_policy",
    "parse_spec",
    "policy_from_mapping",
    "policy_from_spec",
    "policy_to_toml",
    "read_toml",
]

_ROLE_KEYS = ("params", *ROLE_FIELDS)
_KEYS = (
    "base",
    *_ROLE_KEYS,
    *LIST_NAMES,
    *(f"{n}+" for n in LIST_NAMES),
    "modules",
    "class:<glob>",
    "path:<glob>",
)


def _unknown_key(key: str, text: str) -> PolicyError:
    close = difflib.get_close_matches(key, _KEYS, n=2, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return PolicyError(
        f"unknown key {key!r} in policy spec {text!r}.{hint} Valid keys: base, "
        f"{', '.join(ROLE_FIELDS)} (params for param), the op lists {', '.join(LIST_NAMES)} "
        "(with '=' to set a list or '+=' to move ops into it), modules=none, class:<glob>=..., "
        "path:<glob>=..."
    )


def parse_spec(text: str) -> Policy:
    """The policy a key-grammar string describes (see the module docstring)."""
    base: str | None = None
    roles: dict[str, str] = {}
    op_edits: list[tuple[bool, str, list[str]]] = []  # (move?, list, ops)
    module_edits: list[ModuleRule | None] = []  # None: drop all rules
    for position, item in enumerate(split_items(text)):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep:
            if position == 0:
                base = item
                continue
            raise PolicyError(
                f"item {item!r} of policy spec {text!r} is not key=value; only the first item "
                "may be a bare preset name"
            )
        if key == "base" or key in _ROLE_KEYS:
            if key in roles or (key == "base" and base is not None):
                raise PolicyError(f"key {key!r} is given twice in policy spec {text!r}")
            if key == "base":
                base = value
            else:
                roles[key] = value
        elif key.endswith("+"):
            op_edits.append((True, list_name(key[:-1].strip()), split_ops(value)))
        elif key in LIST_NAMES:
            op_edits.append((False, key, split_ops(value)))
        elif key == "modules":
            if value.lower() != "none":
                raise PolicyError(
                    f"'modules' takes only the value 'none' (drop every module rule), got "
                    f"{value!r}; add rules with class:<glob>=<dtype> or path:<glob>=<dtype>"
                )
            module_edits.append(None)
        elif key.startswith(("class:", "path:")):
            module_edits.append(parse_module_rule(key, value))
        else:
            raise _unknown_key(key, text)
    if "param" in roles and "params" in roles:
        raise PolicyError(f"give 'param' or 'params' in policy spec {text!r}, not both")
    policy = derive(preset(base or "auto"), roles)
    ops = policy.ops
    for move, lst, names in op_edits:
        ops = ops.edited(**{lst: names}) if move else ops.replaced(**{lst: names})
    modules = policy.modules
    for rule in module_edits:
        modules = () if rule is None else with_rule(modules, rule)
    return dataclasses.replace(policy, ops=ops, modules=modules, name=None)


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


def _format_from(policy: Policy, base_name: str) -> str:
    base = preset(base_name)
    over: dict[str, Any] = {}
    if policy.compute != base.compute:
        over["compute"] = policy.compute
    start = derive(base, over)
    for role in ("param", "output", "master", "reduce"):
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


def format_policy(policy: Policy) -> str:
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


def policy_to_toml(policy: Policy) -> str:
    """A complete TOML document for ``policy`` (:func:`mixprec.load_toml` reads it back)."""
    data = policy.to_dict()
    data["master"] = data["master"] or "none"  # TOML has no null
    data["modules"] = [
        {key: value for key, value in rule.items() if value not in (None, {})}
        for rule in data["modules"]
    ]
    header = f"mixprec policy {str(policy)!r}\nread it back with mixprec.load_toml(path)"
    return toml_dumps(data, header=header)


# ---------------------------------------------------------------------- mappings and TOML

_MAPPING_KEYS = (
    "base",
    "name",
    *_ROLE_KEYS,
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


def policy_from_mapping(d: Mapping[str, Any]) -> Policy:
    """A policy from a mapping (the :meth:`Policy.to_dict` form, or a partial one).

    Keys: ``base`` (a preset to start from; ``"auto"`` if absent), ``name`` (display only),
    the role fields, ``ops`` (lists set exactly: ``{"fp32": ["softmax"]}`` makes the fp32
    list just softmax), ``move_ops`` (ops moved into lists, like :meth:`Policy.with_ops`),
    ``modules`` (the complete list of module rules) and ``add_modules`` (rules added to the
    base's, or replacing the base's rule for the same pattern).
    """
    unknown = sorted(set(d) - set(_MAPPING_KEYS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], _MAPPING_KEYS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise PolicyError(
            f"unknown policy keys {unknown}.{hint} Valid keys: {', '.join(_MAPPING_KEYS)}"
        )
    policy = derive(preset(d.get("base", "auto")), {k: d[k] for k in _ROLE_KEYS if k in d})
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


def read_toml(path_or_text: str | os.PathLike[str]) -> Policy:
    """A policy from a TOML file or TOML text (keys as in :func:`policy_from_mapping`)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef,import-not-found,unused-ignore]
        except ImportError:
            raise PolicyError(
                "reading TOML policies needs Python 3.11+ (tomllib) or `pip install tomli`"
            ) from None
    text = os.fspath(path_or_text)
    if isinstance(path_or_text, os.PathLike) or (
        "\n" not in text and text.strip().endswith(".toml")
    ):
        try:
            text = Path(text).read_text(encoding="utf-8")
        except OSError as err:
            raise PolicyError(
                f"cannot read policy file {os.fspath(path_or_text)!r}: {err}"
            ) from err
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise PolicyError(f"policy TOML is not valid TOML: {err}") from err
    return policy_from_mapping(data)


def policy_from_spec(spec: object) -> Policy:
    """A policy from a key-grammar string, a ``.toml`` path, or a mapping."""
    if isinstance(spec, Mapping):
        return policy_from_mapping(spec)
    if isinstance(spec, os.PathLike) or (isinstance(spec, str) and spec.strip().endswith(".toml")):
        return read_toml(Path(spec))
    if isinstance(spec, str):
        return parse_spec(spec)
    raise PolicyError(
        "a policy spec is a preset name, a key-grammar string, a .toml path, a Policy or "
        f"a dict; got {type(spec).__name__}"
    )
