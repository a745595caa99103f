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

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeVar, cast

from mixprec.dtypes import FLOAT32, canonical_dtype, widest
from mixprec.errors import PolicyError
from mixprec.policy.ops import ban_advice, check_op_name
from mixprec.policy.rules import ListName, ModuleRule, OpRules

__all__ = [
    "Decision",
    "RuleSource",
    "Source",
    "consult",
    "explain",
    "module_rule",
    "pinned_dtype",
    "winner",
]

Source = Literal["module-op", "module-path", "module-class", "global", "default"]
Classes = str | tuple[str, ...] | None
T = TypeVar("T")
_KINDS = ("path", "class")


class RuleSource(Protocol):
    """What the chain reads from a policy; :class:`mixprec.Policy` is one.

    The chain is typed against this small protocol so it sits below the policy module (the
    policy calls the chain, the chain never imports the policy).
    """

    @property
    def modules(self) -> tuple[ModuleRule, ...]: ...
    @property
    def ops(self) -> OpRules: ...
    @property
    def compute(self) -> str: ...
    @property
    def param(self) -> str: ...
    @property
    def label(self) -> str: ...
    @property
    def is_resolved(self) -> bool: ...


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


def module_rule(
    rules: Iterable[ModuleRule], module: str | None, classes: Classes,
    says: Callable[[ModuleRule], T | None],
) -> tuple[ModuleRule, T] | None:  # fmt: skip
    """Rule precedence, the one place it is written: the module rule that decides ``says``.

    ``says`` is what a rule has to say (its pinned dtype, the list it puts an op in), or None
    when it says nothing. Path rules come first: if a matching path rule says something, it
    decides, else a matching class rule does. Matching rules of the same kind that say
    different things are ambiguous. :meth:`mixprec.Policy.decide`, the dtype reports of
    :mod:`mixprec.engine.diagnostics` and MXNet's graph pass all ask this function.

    :returns: the deciding rule and what it says, or None when no matching rule says anything.
    :raises PolicyError: two matching rules of the deciding kind disagree (naming both).
    """
    saying = [(rule, said) for rule in rules if (said := says(rule)) is not None]
    for kind in _KINDS:
        found = [(r, said) for r, said in saying if r.match == kind and r.matches(module, classes)]
        if not found:
            continue
        first, value = found[0]
        for other, other_value in found[1:]:
            if other_value != value:
                raise PolicyError(
                    f"ambiguous module rules: {first} and {other} both match module "
                    f"{module!r} (class {classes!r}) and disagree ({value} vs {other_value}). "
                    "Make the patterns disjoint, or drop one of the rules"
                )
        return first, value
    return None


def _of_kind(policy: RuleSource, kind: str) -> list[ModuleRule]:
    return [rule for rule in policy.modules if rule.match == kind]


def _step(
    policy: RuleSource, kind: str, module: str | None, classes: Classes,
    says: Callable[[ModuleRule], T | None],
) -> tuple[ModuleRule, T] | PolicyError | None:  # fmt: skip
    """One kind's outcome for :func:`consult`: ambiguity is kept as the step's outcome."""
    try:
        return module_rule(_of_kind(policy, kind), module, classes, says)
    except PolicyError as err:
        return err


def _pin(policy: RuleSource, kind: str, module: str | None, classes: Classes) -> Outcome:
    """Steps 3 and 4: the dtype the matching ``kind`` rules pin."""
    agreed = _step(policy, kind, module, classes, _dtype)
    if not isinstance(agreed, tuple):
        return agreed
    source: Source = "module-path" if kind == "path" else "module-class"
    return Decision(agreed[1], f"{kind} rule {agreed[0]}", source)


def _dtype(rule: ModuleRule) -> str | None:
    return rule.dtype


def pinned_dtype(policy: RuleSource, module: str | None, classes: Classes) -> str | None:
    """The dtype module rules pin this module to (path rules first), or None.

    :raises PolicyError: two matching rules of the same kind pin different dtypes.
    """
    found = module_rule(policy.modules, module, classes, _dtype)
    return None if found is None else found[1]


def _list_dtype(
    policy: RuleSource, lst: ListName, op: str, floats: Sequence[str], module: str | None,
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
    policy: RuleSource, lst: ListName, op: str, floats: Sequence[str], module: str | None,
    classes: Classes, rule: str, source: Source,
) -> Decision | PolicyError:  # fmt: skip
    dtype = _list_dtype(policy, lst, op, floats, module, classes)
    return dtype if isinstance(dtype, PolicyError) else Decision(dtype, rule, source)


def _module_op(
    policy: RuleSource, kind: str, op: str, floats: Sequence[str], module: str | None,
    classes: Classes,
) -> Outcome:  # fmt: skip
    """Steps 1 and 2: the list the matching ``kind`` rules put ``op`` in."""
    agreed = _step(policy, kind, module, classes, _op_of(op))
    if not isinstance(agreed, tuple):
        return agreed
    rule, lst = agreed[0], cast("ListName", agreed[1])  # mypy widens the Literal to str
    text = f"{kind} rule {rule} ({op} in {lst})"
    return _by_list(policy, lst, op, floats, module, classes, text, "module-op")


def _op_of(op: str) -> Callable[[ModuleRule], ListName | None]:
    return lambda rule: rule.op_list(op)


def _floats(inputs: Sequence[object]) -> list[str]:
    floats = []
    for dtype in inputs:
        try:
            floats.append(canonical_dtype(dtype))
        except PolicyError:
            continue  # integer and bool inputs take no part
    return floats


def consult(
    policy: RuleSource, op: str, inputs: Sequence[object], module: str | None, classes: Classes
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
    policy: RuleSource, op: str, inputs: Sequence[str], module: str | None, classes: Classes
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
