"""How a policy decides the dtype of one op: the chain of rules behind decide() and explain().

The chain has five steps, and the first one with an outcome decides:

1. op rules inside matching *path* rules;
2. op rules inside matching *class* rules;
3. the dtype matching path rules pin;
4. the dtype matching class rules pin;
5. the global op lists (an op in no list passes through).

Within a step, matching rules that disagree are ambiguous and the outcome is an error
naming both. Later steps are still evaluated, so :func:`explain` can show them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeVar

from mixprec.dtypes import FLOAT32, canonical_dtype, widest
from mixprec.errors import PolicyError
from mixprec.ops import ban_advice, check_op_name
from mixprec.rules import ListName, ModuleRule

if TYPE_CHECKING:
    from mixprec.policy import Policy

__all__ = ["Decision", "Source", "consult", "explain", "pinned_dtype", "winner"]

Source = Literal["module-op", "module-path", "module-class", "global", "default"]
Classes = str | tuple[str, ...] | None
T = TypeVar("T")
_KINDS = ("path", "class")


@dataclass(frozen=True)
class Decision:
    """The dtype an op runs in, the rule that chose it, and which kind of rule that was."""

    dtype: str
    rule: str
    source: Source


Outcome = Decision | PolicyError | None


@dataclass
class Step:
    """One step of the chain: what it looked at, and its outcome (None: no opinion)."""

    title: str
    notes: list[str] = field(default_factory=list)
    outcome: Decision | PolicyError | None = None


def _agree(
    rules: Sequence[ModuleRule], value: Callable[[ModuleRule], T], module: str | None,
    classes: Classes,
) -> tuple[ModuleRule, T] | PolicyError | None:  # fmt: skip
    """The outcome all ``rules`` agree on, an ambiguity error, or None when there are none."""
    if not rules:
        return None
    first = rules[0]
    for other in rules[1:]:
        if value(other) != value(first):
            return PolicyError(
                f"ambiguous module rules: {first} and {other} both match module {module!r} "
                f"(class {classes!r}) and disagree ({value(first)} vs {value(other)}). Make "
                "the patterns disjoint, or drop one of the rules"
            )
    return first, value(first)


def _pin(policy: Policy, kind: str, module: str | None, classes: Classes) -> Outcome:
    """Steps 3 and 4: the dtype the matching ``kind`` rules pin."""
    pins = [r for r in policy.modules if r.match == kind and r.dtype is not None]
    agreed = _agree([r for r in pins if r.matches(module, classes)], _dtype, module, classes)
    if not isinstance(agreed, tuple):
        return agreed
    source: Source = "module-path" if kind == "path" else "module-class"
    return Decision(agreed[1], f"{kind} rule {agreed[0]}", source)


def _dtype(rule: ModuleRule) -> str:
    return rule.dtype or ""


def pinned_dtype(policy: Policy, module: str | None, classes: Classes) -> str | None:
    """The dtype module rules pin this module to (path rules first), or None.

    :raises PolicyError: two matching rules of the same kind pin different dtypes.
    """
    for kind in _KINDS:
        outcome = _pin(policy, kind, module, classes)
        if isinstance(outcome, PolicyError):
            raise outcome
        if outcome is not None:
            return outcome.dtype
    return None


def _list_dtype(
    policy: Policy, lst: ListName, op: str, floats: Sequence[str], module: str | None,
    classes: Classes,
) -> str | PolicyError:  # fmt: skip
    """What a list means: lowp → compute, fp32 → float32, promote → widest input, ..."""
    if lst == "lowp":
        return policy.compute
    if lst == "fp32":
        return FLOAT32
    if lst == "banned":
        return PolicyError(f"op {op!r} is banned by policy {policy.label}: {ban_advice(op)}")
    if floats:
        return widest(floats) if lst == "promote" else floats[0]
    try:  # no floating input: the module's own param dtype
        return pinned_dtype(policy, module, classes) or policy.param
    except PolicyError as err:
        return err


def _by_list(
    policy: Policy, lst: ListName, op: str, floats: Sequence[str], module: str | None,
    classes: Classes, rule: str, source: Source,
) -> Decision | PolicyError:  # fmt: skip
    dtype = _list_dtype(policy, lst, op, floats, module, classes)
    return dtype if isinstance(dtype, PolicyError) else Decision(dtype, rule, source)


def _module_op(
    policy: Policy, kind: str, op: str, floats: Sequence[str], module: str | None,
    classes: Classes,
) -> Outcome:  # fmt: skip
    """Steps 1 and 2: the list the matching ``kind`` rules put ``op`` in."""
    said = [r for r in policy.modules if r.match == kind and r.op_list(op) is not None]
    agreed = _agree([r for r in said if r.matches(module, classes)], _op_of(op), module, classes)
    if not isinstance(agreed, tuple):
        return agreed
    rule, lst = agreed
    text = f"{kind} rule {rule} ({op} in {lst})"
    return _by_list(policy, lst, op, floats, module, classes, text, "module-op")


def _op_of(op: str) -> Callable[[ModuleRule], ListName]:
    return lambda rule: rule.op_list(op) or "passthrough"


def _floats(inputs: Sequence[object]) -> list[str]:
    floats = []
    for dtype in inputs:
        try:
            floats.append(canonical_dtype(dtype))
        except PolicyError:
            continue  # integer and bool inputs take no part
    return floats


def consult(
    policy: Policy, op: str, inputs: Sequence[object], module: str | None, classes: Classes
) -> list[Step]:
    """Every step of the chain for one op, each with its outcome."""
    if not policy.is_resolved:
        error = PolicyError(
            "policy 'auto' is not resolved yet: a backend resolves it at wrap time, or call "
            "mixprec.resolve_auto(policy, 'bfloat16') yourself"
        )
        return [Step("the policy is 'auto'", [], error)]
    check_op_name(op)
    floats = _floats(inputs)

    def notes(kind: str, says: Callable[[ModuleRule], str]) -> list[str]:
        rules = [r for r in policy.modules if r.match == kind]
        said = [f"{r}: {says(r) if r.matches(module, classes) else 'no match'}" for r in rules]
        return said or [f"(no {kind} rules)"]

    steps = [
        Step(
            f"op rules inside {kind} rules",
            notes(kind, lambda r: _op_note(r, op)),
            _module_op(policy, kind, op, floats, module, classes),
        )
        for kind in _KINDS
    ]
    steps += [
        Step(
            f"dtype pinned by {kind} rules",
            notes(kind, _pin_note),
            _pin(policy, kind, module, classes),
        )
        for kind in _KINDS
    ]
    listed = policy.ops.list_of(op)
    if listed is None:
        note = f"{op} is in no list: it passes through"
        text = f"default: {op} is in no list (passthrough)"
        outcome = _by_list(policy, "passthrough", op, floats, module, classes, text, "default")
    else:
        note = f"{op} is in the {listed} list"
        text = f"global {listed} list"
        outcome = _by_list(policy, listed, op, floats, module, classes, text, "global")
    steps.append(Step("global op lists", [note], outcome))
    return steps


def _op_note(rule: ModuleRule, op: str) -> str:
    lst = rule.op_list(op)
    return f"matches, puts {op} in {lst}" if lst else f"matches, says nothing about {op}"


def _pin_note(rule: ModuleRule) -> str:
    return f"matches, pins {rule.dtype}" if rule.dtype else "matches, pins no dtype"


def winner(steps: list[Step]) -> Decision | PolicyError:
    """The outcome of the first step that has one."""
    for step in steps:
        if step.outcome is not None:
            return step.outcome
    raise AssertionError("the global step always decides")  # pragma: no cover


def explain(
    policy: Policy, op: str, inputs: Sequence[str], module: str | None, classes: Classes
) -> str:
    """The chain as text: every step, what matched, and which step decided."""
    where = [f"inputs {', '.join(inputs) or 'none'}"]
    if module is not None:
        where.append(f"module {module!r}")
    if classes is not None:
        where.append(f"class {classes if isinstance(classes, str) else ', '.join(classes)}")
    lines = [f"policy {policy.label}: op {op!r} ({'; '.join(where)})"]
    result = ""
    for number, step in enumerate(consult(policy, op, inputs, module, classes), 1):
        lines.append(f"  {number}. {step.title}")
        lines.extend(f"       {note}" for note in step.notes)
        if step.outcome is None:
            continue
        if result:
            lines.append("       (not reached: an earlier step decided)")
        elif isinstance(step.outcome, PolicyError):
            lines.append("       -> this step decides: decide() raises PolicyError")
            result = f"Result: error: {step.outcome}"
        else:
            lines.append(f"       -> {step.outcome.dtype}  <- this step decides")
            result = f"Result: {step.outcome.dtype}, by {step.outcome.rule}"
    lines.append(result)
    return "\n".join(lines)
