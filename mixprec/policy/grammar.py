"""The text pieces of policy specs: items, op lists, loss scales, module rules, TOML.

Nothing here knows about presets; :mod:`mixprec.engine.spec` assembles these pieces into whole
policies. The loss-scale grammar::

    none                                  NoScale()
    dynamic                               DynamicScale()
    dynamic(init=1024,interval=100,...)   DynamicScale(init=1024.0, interval=100, ...)
    static:1024   (or just 1024)          StaticScale(1024.0)

A module rule's value is a dtype, op rules in parentheses, or both::

    class:*BatchNorm*=float32
    path:encoder.*.attn=float16(fp32=softmax|exp,lowp=bmm)
    path:head=(fp32=softmax)
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import reprlib
from collections.abc import Mapping
from typing import Any

from mixprec.errors import PolicyError
from mixprec.numerics.loss_scale import (
    LOSS_SCALE_KINDS,
    DynamicScale,
    LossScaleConfig,
    NoScale,
    StaticScale,
)
from mixprec.policy.rules import ListName, ModuleRule, list_name

__all__ = [
    "DYNAMIC_FIELDS",
    "check_policy_mapping",
    "format_loss_scale",
    "format_number",
    "loss_scale_from_value",
    "parse_module_rule",
    "split_items",
    "split_ops",
    "toml_dumps",
]

# DynamicScale's running fields; everything else configures it
_RUNNING = frozenset({"scale", "good_steps", "overflows_left"})
#: The DynamicScale fields a policy keeps (its configuration), in declaration order.
DYNAMIC_FIELDS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(DynamicScale) if f.name not in _RUNNING
)
_DEFAULT_DYNAMIC = DynamicScale()
_LOSS_SCALE_FORMS = (
    "'none', 'dynamic', 'static:<scale>' (e.g. 'static:1024'), a number, or "
    f"'dynamic(<key>=<value>,...)' with keys {', '.join(DYNAMIC_FIELDS)}"
)


def split_items(text: str) -> list[str]:
    """Split on the commas outside parentheses; drop empty items; strip whitespace."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth < 0:
                raise PolicyError(f"unbalanced ')' in policy spec {text!r}")
        elif char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise PolicyError(f"unbalanced '(' in policy spec {text!r}")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def split_ops(value: str) -> list[str]:
    """``"softmax|exp"`` → ``["softmax", "exp"]`` (an empty value is an empty list)."""
    return [op.strip() for op in value.split("|") if op.strip()]


def format_number(x: float | str) -> str:
    """The shortest text that reads back to ``x``: ``1024.0`` → ``"1024"``."""
    if isinstance(x, str):
        return x
    if isinstance(x, float) and math.isfinite(x) and x.is_integer() and abs(x) < 2.0**53:
        return str(int(x))
    return repr(x)


def _number(key: str, text: str, kind: type) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise PolicyError(
            f"loss_scale {key}={text!r} is not a{'n integer' if kind is int else ' number'}; "
            f"write {_LOSS_SCALE_FORMS}"
        ) from None
    return value


def _parse_loss_scale(text: str) -> LossScaleConfig:
    low = text.strip().lower()
    if low == "none":
        return NoScale()
    if low == "dynamic":
        return DynamicScale()
    if low.startswith("static:"):
        return StaticScale(_number("static", low[7:].strip(), float))
    if low.startswith("dynamic(") and low.endswith(")"):
        config: dict[str, Any] = {}
        for item in split_items(text.strip()[8:-1]):
            key, sep, value = (part.strip() for part in item.partition("="))
            if not sep or key not in DYNAMIC_FIELDS or key in config:
                problem = "repeated" if key in config else "unknown"
                raise PolicyError(
                    f"{problem} dynamic loss-scale setting {item!r} in {text!r}; write "
                    f"dynamic(<key>=<value>,...) with keys {', '.join(DYNAMIC_FIELDS)}"
                )
            default = getattr(_DEFAULT_DYNAMIC, key)
            config[key] = value if isinstance(default, str) else _number(key, value, type(default))
        return DynamicScale(**config)
    try:
        return StaticScale(float(low))
    except ValueError:
        raise PolicyError(f"bad loss_scale {text!r}; write {_LOSS_SCALE_FORMS}") from None


def _loss_scale_from_mapping(d: Mapping[str, Any]) -> LossScaleConfig:
    kind = d.get("kind")
    cls = LOSS_SCALE_KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise PolicyError(
            f"loss_scale table needs kind = one of {sorted(LOSS_SCALE_KINDS)}, "
            f"got {d.get('kind')!r}"
        )
    allowed = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - allowed - {"kind"})
    if unknown:
        raise PolicyError(
            f"unknown {cls.kind!r} loss-scale keys {unknown}; valid keys: "
            f"{', '.join(['kind', *sorted(allowed)])}"
        )
    return cls(**{k: v for k, v in d.items() if k != "kind"})


def loss_scale_from_value(value: object) -> LossScaleConfig:
    """A loss-scale configuration from any form a spec may hold, reset to a fresh state.

    Accepts a loss-scale object, a string in the grammar above, a number (static scale),
    or a mapping (``state_dict()`` form, or a partial one with ``kind``).
    """
    if isinstance(value, NoScale | StaticScale | DynamicScale):
        state: LossScaleConfig = value
    elif isinstance(value, str):
        state = _parse_loss_scale(value)
    elif isinstance(value, Mapping):
        state = _loss_scale_from_mapping(value)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        state = StaticScale(value)  # it checks: an int beyond float is refused
    else:
        raise PolicyError(f"bad loss_scale {value!r}; write {_LOSS_SCALE_FORMS}")
    return state.fresh()


def format_loss_scale(state: LossScaleConfig) -> str:
    """The grammar form of a loss-scale configuration; only non-default settings appear."""
    if isinstance(state, NoScale):
        return "none"
    if isinstance(state, StaticScale):
        return f"static:{format_number(state.scale)}"
    changed = [
        f"{key}={format_number(getattr(state, key))}"
        for key in DYNAMIC_FIELDS
        if getattr(state, key) != getattr(_DEFAULT_DYNAMIC, key)
    ]
    return f"dynamic({','.join(changed)})" if changed else "dynamic"


_MODULE_VALUE = re.compile(r"([^()\s]*)\s*(?:\((.*)\))?", re.DOTALL)


def parse_module_rule(key: str, value: str) -> ModuleRule:
    """``("path:head", "float16(fp32=softmax|exp)")`` → the :class:`ModuleRule` it spells."""
    match, _, pattern = key.partition(":")
    found = _MODULE_VALUE.fullmatch(value.strip())
    if found is None:
        raise PolicyError(
            f"bad module rule value {value!r}; write a dtype ('float32'), op rules "
            "('(fp32=softmax|exp)') or both ('float16(fp32=softmax)')"
        )
    ops: dict[str, ListName] = {}
    for item in split_items(found[2] or ""):
        lst, sep, names = (part.strip() for part in item.partition("="))
        if not sep:
            raise PolicyError(f"bad module op rule {item!r}; write <list>=<op>|<op>")
        for op in split_ops(names):
            if ops.setdefault(op, list_name(lst)) != lst:
                raise PolicyError(
                    f"module rule {key}={value} puts {op!r} in two lists; name it in one"
                )
    return ModuleRule(match.strip(), pattern.strip(), found[1] or None, ops)


# ---------------------------------------------------------------------- mapping shapes

_SCALAR = (str, int, float, bool)
_ROLE_OR_NAME = frozenset(
    ("base", "name", "params", "param", "compute", "output", "master", "reduce", "state")
)
_short = reprlib.Repr()
_short.maxlevel, _short.maxstring, _short.maxother = 3, 60, 60


def _shown(value: object) -> str:
    """``repr(value)``, bounded in length and depth (a hostile file can nest 10,000 deep)."""
    return _short.repr(value)


def _op_lists(where: str, value: object) -> None:
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, (list, tuple)) and all(isinstance(op, str) for op in v)
        for k, v in value.items()
    ):
        raise PolicyError(
            f"{where} must map op lists to lists of op names, e.g. {{'fp32': ['softmax']}}; "
            f"got {_shown(value)}"
        )


def _module_rules(where: str, value: object) -> None:
    if not isinstance(value, (list, tuple)):
        raise PolicyError(
            f"{where} must be a list of module rules (tables with match, pattern, dtype and/or "
            f"ops, or strings such as 'class:*BatchNorm*=float32'); got {_shown(value)}"
        )
    for rule in value:
        if isinstance(rule, (str, ModuleRule)):
            continue
        if not isinstance(rule, Mapping) or not all(_rule_item(k, v) for k, v in rule.items()):
            raise PolicyError(
                f"bad module rule {_shown(rule)} in {where}; give a table with keys match "
                "('class' or 'path'), pattern, dtype (strings) and/or ops (a table of "
                "op = list name)"
            )


def _rule_item(key: object, value: object) -> bool:
    """Whether one entry of a module-rule table has its shape: ``ops`` a table of op = list
    name, the others strings (or None)."""
    if key == "ops":
        return isinstance(value, Mapping) and all(
            isinstance(op, str) and isinstance(where, str) for op, where in value.items()
        )
    return isinstance(key, str) and (value is None or isinstance(value, str))


def check_policy_mapping(d: object) -> None:
    """Refuse a policy mapping (a TOML file, a checkpoint's saved policy) whose values have
    the wrong shape, before any of it is read: each role and ``base``/``name`` a string (or
    None), ``ops``/``move_ops`` tables of lists of op names, ``modules``/``add_modules`` lists
    of rules, ``loss_scale`` a string, a number or a flat table of them.

    :raises PolicyError: naming the key, what it must be, and (bounded) what it was.
    """
    if not isinstance(d, Mapping) or not all(isinstance(k, str) for k in d):
        raise PolicyError(f"a policy mapping must be a table of named settings, got {_shown(d)}")
    for key, value in d.items():
        if key in _ROLE_OR_NAME and not (value is None or isinstance(value, str)):
            raise PolicyError(
                f"policy key {key!r} must be a string (a preset or dtype name), got {_shown(value)}"
            )
        if key in ("ops", "move_ops"):
            _op_lists(repr(key), value)
        if key in ("modules", "add_modules"):
            _module_rules(repr(key), value)
        if key == "loss_scale" and not (
            isinstance(value, _SCALAR)
            or isinstance(value, (NoScale, StaticScale, DynamicScale))
            or (
                isinstance(value, Mapping)
                and all(isinstance(k, str) and isinstance(v, _SCALAR) for k, v in value.items())
            )
        ):
            raise PolicyError(f"bad loss_scale {_shown(value)}; write {_LOSS_SCALE_FORMS}")


# ---------------------------------------------------------------------- TOML writing

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else repr(value)  # repr gives inf/-inf/1e-05
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are valid TOML basic-string escapes
    if isinstance(value, list | tuple):
        if len(value) > 3:
            return "[\n" + "".join(f"    {_toml_value(v)},\n" for v in value) + "]"
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        pairs = (f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items() if v is not None)
        return "{ " + ", ".join(pairs) + " }" if value else "{}"
    raise TypeError(f"cannot write {value!r} as TOML")


def _is_table(value: Any) -> bool:
    return isinstance(value, Mapping)


def _is_table_array(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, Mapping) for v in value)


def _pairs(table: Mapping[str, Any]) -> list[str]:
    return [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items() if v is not None]


def toml_dumps(data: Mapping[str, Any], header: str = "") -> str:
    """A TOML document for plain data: keys with None values are left out.

    Top-level mappings become ``[tables]``, lists of mappings ``[[arrays of tables]]``;
    anything nested deeper is written inline.
    """
    lines = [f"# {line}" for line in header.splitlines()]
    plain = {k: v for k, v in data.items() if not _is_table(v) and not _is_table_array(v)}
    lines.extend(_pairs(plain))
    for key, value in data.items():
        if _is_table(value):
            lines += ["", f"[{_toml_key(key)}]", *_pairs(value)]
        elif _is_table_array(value):
            for item in value:
                lines += ["", f"[[{_toml_key(key)}]]", *_pairs(item)]
    return "\n".join(lines) + "\n"
