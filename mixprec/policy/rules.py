"""The two kinds of rule a policy holds: global op lists and module rules.

:class:`OpRules` puts each op in at most one of five lists; :class:`ModuleRule` overrides
the policy for the modules whose class name or qualified name matches a glob. Both are
re-exported by :mod:`mixprec.policy.value`, which is where they are documented for users.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Literal

from mixprec.dtypes import canonical_dtype
from mixprec.errors import PolicyError
from mixprec.policy.ops import check_op_name

__all__ = ["LIST_NAMES", "ListName", "ModuleRule", "OpRules", "list_name", "with_rule"]

ListName = Literal["lowp", "fp32", "promote", "passthrough", "banned"]
#: The five op lists, in the order they are printed.
LIST_NAMES: tuple[ListName, ...] = ("lowp", "fp32", "promote", "passthrough", "banned")

_LIST_MEANING = {
    "lowp": "runs in the policy's compute dtype",
    "fp32": "runs in float32",
    "promote": "runs in the widest floating input dtype",
    "passthrough": "runs in the dtype of its first floating input",
    "banned": "raises an error with advice",
}


def list_name(name: str) -> ListName:
    """``name`` if it is one of the five op lists, else :class:`PolicyError` listing them."""
    if name in LIST_NAMES:
        return name
    close = difflib.get_close_matches(str(name), LIST_NAMES, n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise PolicyError(
        f"unknown op list {name!r}.{hint} The op lists are: "
        + "; ".join(f"{n} ({_LIST_MEANING[n]})" for n in LIST_NAMES)
    )


def _op_set(ops: Iterable[str], what: str) -> frozenset[str]:
    if isinstance(ops, str):
        raise PolicyError(f"{what} must be a list of op names, not the string {ops!r}")
    return frozenset(check_op_name(op) for op in ops)


@dataclass(frozen=True, init=False)
class OpRules:
    """Five disjoint sets of op names: ``lowp``, ``fp32``, ``promote``, ``passthrough``,
    ``banned``.

    An op in no list behaves as passthrough. Ops are neutral families
    (:data:`mixprec.policy.ops.OP_FAMILIES`) or ``"<backend>:<native>"`` names.

    :raises PolicyError: an unknown op, or one op in two lists.
    """

    lowp: frozenset[str]
    fp32: frozenset[str]
    promote: frozenset[str]
    passthrough: frozenset[str]
    banned: frozenset[str]
    _index: dict[str, ListName] = field(init=False, repr=False, compare=False, hash=False)

    def __init__(
        self,
        lowp: Iterable[str] = (),
        fp32: Iterable[str] = (),
        promote: Iterable[str] = (),
        passthrough: Iterable[str] = (),
        banned: Iterable[str] = (),
    ) -> None:
        index: dict[str, ListName] = {}
        given = {
            "lowp": lowp,
            "fp32": fp32,
            "promote": promote,
            "passthrough": passthrough,
            "banned": banned,
        }
        for name in LIST_NAMES:
            ops = _op_set(given[name], name)
            for op in ops:
                if op in index:
                    raise PolicyError(
                        f"op {op!r} is in two lists, {index[op]!r} and {name!r}; an op "
                        f"belongs to one list. Keep it in one, e.g. with_ops({name}=[{op!r}]) "
                        f"moves it to {name!r}"
                    )
                index[op] = name
            object.__setattr__(self, name, ops)
        object.__setattr__(self, "_index", index)

    def __repr__(self) -> str:
        parts = (f"{n}={sorted(getattr(self, n))!r}" for n in LIST_NAMES if getattr(self, n))
        return f"OpRules({', '.join(parts)})"

    def list_of(self, op: str) -> ListName | None:
        """The list ``op`` is in, or None when it is in none (it then passes through)."""
        return self._index.get(op)

    @property
    def listed(self) -> frozenset[str]:
        """Every op named in some list."""
        return frozenset(self._index)

    def lists(self) -> dict[ListName, list[str]]:
        """The five lists as sorted lists (the dict/TOML form)."""
        return {name: sorted(getattr(self, name)) for name in LIST_NAMES}

    def _given(self, lists: Mapping[str, Iterable[str]]) -> dict[ListName, frozenset[str]]:
        given = {list_name(name): _op_set(ops, name) for name, ops in lists.items()}
        seen: dict[str, str] = {}
        for name, ops in given.items():
            for op in ops:
                if op in seen:
                    raise PolicyError(
                        f"op {op!r} is given for two lists, {seen[op]!r} and {name!r}; "
                        "name each op once"
                    )
                seen[op] = name
        return given

    def edited(self, **lists: Iterable[str]) -> OpRules:
        """Move ops into lists: ``rules.edited(fp32=["softmax"], lowp=["bmm"])``.

        Each named op leaves whatever list it was in. Other ops stay where they are.
        """
        given = self._given(lists)
        moved = frozenset().union(*given.values()) if given else frozenset()
        return OpRules(
            **{
                name: (getattr(self, name) - moved) | given.get(name, frozenset())
                for name in LIST_NAMES
            }
        )

    def replaced(self, **lists: Iterable[str]) -> OpRules:
        """Set the named lists to exactly the given ops.

        The given ops leave the other lists; ops that were in a named list and are not
        given any more end up in no list (so they pass through).
        """
        given = self._given(lists)
        moved = frozenset().union(*given.values()) if given else frozenset()
        return OpRules(
            **{
                name: given[name] if name in given else getattr(self, name) - moved
                for name in LIST_NAMES
            }
        )


MatchKind = Literal["class", "path"]
_BAD_PATTERN = re.compile(r"[\s,=()|\"'#]")


def _rule_ops(
    ops: Mapping[str, str] | Iterable[tuple[str, str]] | None,
) -> tuple[tuple[str, ListName], ...]:
    pairs = ops.items() if isinstance(ops, Mapping) else (ops or ())
    out: dict[str, ListName] = {}
    for pair in pairs:
        if isinstance(pair, str) or len(pair) != 2:
            raise PolicyError(
                f"module-rule ops must map op names to lists, e.g. {{'softmax': 'fp32'}}; "
                f"got {pair!r}"
            )
        op, lst = check_op_name(pair[0]), list_name(pair[1])
        if out.get(op, lst) != lst:
            raise PolicyError(f"module-rule op {op!r} is given two lists, {out[op]!r} and {lst!r}")
        out[op] = lst
    return tuple(sorted(out.items()))


@dataclass(frozen=True, init=False)
class ModuleRule:
    """Override the policy for the modules a glob matches.

    ``match="class"`` tests ``pattern`` against the module's class name (and every base
    class name a backend passes, so ``"*BatchNorm*"`` also catches subclasses);
    ``match="path"`` tests it against the module's qualified name (``"encoder.*.attn"``).
    Globs are :func:`fnmatch.fnmatchcase` globs: case-sensitive, and ``*`` also spans dots.

    ``dtype`` pins the module: its params and every op inside run in that dtype. ``ops``
    gives op rules that apply inside the module only, as ``(op, list)`` pairs (a mapping
    is accepted too); they win over ``dtype``. A rule needs a ``dtype``, ``ops`` or both.
    """

    match: MatchKind
    pattern: str
    dtype: str | None
    ops: tuple[tuple[str, ListName], ...]
    _ops_index: dict[str, ListName] = field(init=False, repr=False, compare=False, hash=False)

    def __init__(
        self,
        match: str,
        pattern: str,
        dtype: str | None = None,
        ops: Mapping[str, str] | Iterable[tuple[str, str]] | None = (),
    ) -> None:
        if match not in ("class", "path"):
            raise PolicyError(
                f"module rule match must be 'class' (class-name glob) or 'path' "
                f"(qualified-name glob), got {match!r}"
            )
        if not isinstance(pattern, str) or not pattern or _BAD_PATTERN.search(pattern):
            raise PolicyError(
                f"bad module-rule pattern {pattern!r}: give a non-empty glob such as "
                "'*BatchNorm*' or 'encoder.*.attn' without spaces, commas, quotes, '=', '|', "
                "'#' or parentheses"
            )
        rule_ops = _rule_ops(ops)
        if dtype is None and not rule_ops:
            raise PolicyError(
                f"module rule {match}:{pattern} needs a dtype to pin or ops to override, "
                f"e.g. with_module({pattern!r}, 'float32') or "
                f"with_module({pattern!r}, ops={{'softmax': 'fp32'}})"
            )
        set_ = object.__setattr__
        set_(self, "match", match)
        set_(self, "pattern", pattern)
        set_(self, "dtype", None if dtype is None else canonical_dtype(dtype))
        set_(self, "ops", rule_ops)
        set_(self, "_ops_index", dict(rule_ops))

    def matches(self, module: str | None, module_class: str | Sequence[str] | None) -> bool:
        """Whether this rule applies to a module with that qualified name / class name(s)."""
        if self.match == "path":
            return module is not None and fnmatchcase(module, self.pattern)
        if module_class is None:
            return False
        if isinstance(module_class, str):
            return fnmatchcase(module_class, self.pattern)
        return any(fnmatchcase(name, self.pattern) for name in module_class)

    def op_list(self, op: str) -> ListName | None:
        """The list this rule puts ``op`` in inside the module, or None."""
        return self._ops_index.get(op)

    def to_dict(self) -> dict[str, Any]:
        """The rule as plain data: ``match``, ``pattern``, ``dtype`` and ``ops`` (op → list)."""
        return {
            "match": self.match,
            "pattern": self.pattern,
            "dtype": self.dtype,
            "ops": dict(self.ops),
        }

    @property
    def key(self) -> tuple[str, str]:
        """``(match, pattern)``: a policy holds at most one rule per key."""
        return (self.match, self.pattern)

    def __str__(self) -> str:
        """The key-grammar form: ``class:*BatchNorm*=float32``, ``path:head=(fp32=softmax)``."""
        value = self.dtype or ""
        if self.ops:
            groups: dict[str, list[str]] = {}
            for op, lst in self.ops:
                groups.setdefault(lst, []).append(op)
            value += "(" + ",".join(f"{n}={'|'.join(groups[n])}" for n in LIST_NAMES if n in groups)
            value += ")"
        return f"{self.match}:{self.pattern}={value}"


def with_rule(rules: tuple[ModuleRule, ...], rule: ModuleRule) -> tuple[ModuleRule, ...]:
    """``rules`` with ``rule`` replacing the one for its pattern in place, or appended."""
    if any(r.key == rule.key for r in rules):
        return tuple(rule if r.key == rule.key else r for r in rules)
    return (*rules, rule)
