"""Which of a policy's op rules a backend can apply, from its ``capabilities().unseen_ops``.

Imperative frameworks let a backend see every op (torch's dispatcher, MXNet's AMP lists);
a functional one may not: in JAX, ``x + y`` reaches no function a plugin can wrap. A
backend lists such op families as :class:`~mixprec.backend.UnseenOp`\\ s with what the
framework does natively, and this module turns that into:

- :func:`check_rules_visible`: refuse, before anything runs, a policy that needs a cast on
  an op the backend cannot see (the op in ``lowp`` or ``fp32``, globally or inside a module
  rule), since the framework would silently do something else;
- :func:`unseen_notes`: the lines ``explain`` and ``dtype_report`` add for the rules that
  are only the framework's own behaviour (``promote`` where the policy says
  ``passthrough``, a ban that cannot be enforced, a rule on an op the framework lacks).
"""

from __future__ import annotations

from collections.abc import Iterable

from mixprec.backend import Capabilities, UnseenOp
from mixprec.errors import PolicyError
from mixprec.policy.value import Policy

__all__ = ["check_rules_visible", "refused_rules", "unseen_notes"]

_CASTING = ("lowp", "fp32")


def _rules_on(policy: Policy, op: str) -> list[tuple[str, str]]:
    """(where, list) for every rule naming ``op``: the global lists, then module rules."""
    found = []
    listed = policy.ops.list_of(op)
    if listed is not None:
        found.append(("the policy", str(listed)))
    for rule in policy.modules:
        found += [
            (f"module rule {rule.match}:{rule.pattern}", lst) for o, lst in rule.ops if o == op
        ]
    return found


def refused_rules(policy: Policy, capabilities: Capabilities) -> list[str]:
    """One line per rule that casts an op the backend cannot see (empty: all applicable)."""
    lines = []
    for entry in capabilities.unseen_ops:
        if entry.native == "absent":
            continue
        for where, lst in _rules_on(policy, entry.op):
            if lst in _CASTING:
                lines.append(
                    f"{where} puts {entry.op!r} in {lst}, but the {capabilities.backend} backend "
                    f"cannot see {entry.op!r} ({entry.why or 'no hook on it'}): it would run as "
                    f"{entry.native}"
                )
    return lines


def check_rules_visible(policy: Policy, capabilities: Capabilities) -> None:
    """Refuse a policy with a casting rule on an op the backend cannot see.

    :raises PolicyError: naming each such rule and the fix.
    """
    lines = refused_rules(policy, capabilities)
    if lines:
        raise PolicyError(
            f"policy {policy.label} has rules the {capabilities.backend} backend cannot apply:\n  "
            + "\n  ".join(lines)
            + "\nMove those ops back to 'promote' or 'passthrough' (policy.with_ops(...)), or "
            "cast explicitly in your code; `mixprec explain POLICY OP --backend "
            f"{capabilities.backend}` shows what runs"
        )


def _note(policy: Policy, entry: UnseenOp, backend: str) -> str | None:
    """What the rules on ``entry.op`` come to, without the op's name (None: nothing to say)."""
    rules = _rules_on(policy, entry.op) or [("the policy", "passthrough")]
    if entry.native == "absent":
        named = [f"{lst} ({where})" for where, lst in rules if lst != "passthrough"]
        if not named:
            return None
        return f"{backend} has no such op, so {', '.join(named)} has nothing to act on"
    notes = []
    for where, lst in rules:
        if lst == "banned":
            notes.append(f"banned by {where}, but {backend} cannot see it to enforce the ban")
        elif lst in _CASTING:
            notes.append(f"{lst} by {where}, which {backend} cannot apply: refused")
        elif lst != entry.native:
            notes.append(
                f"{lst} by {where}, but {backend} cannot see it and runs it as "
                f"{entry.native} (the same dtype whenever its inputs share one)"
            )
    return "; ".join(notes) or None


def unseen_notes(
    policy: Policy, capabilities: Capabilities, ops: Iterable[str] | None = None
) -> list[str]:
    """For ``explain``/``dtype_report``: the unseen ops (of ``ops``, default all) whose
    rule in ``policy`` is not simply what the framework does natively, one line per
    outcome (``"add, sub, mul, div: passthrough by the policy, but jax ..."``)."""
    wanted = None if ops is None else set(ops)
    grouped: dict[tuple[str, str], list[str]] = {}  # (note, why) -> ops, in declared order
    for entry in capabilities.unseen_ops:
        if wanted is not None and entry.op not in wanted:
            continue
        note = _note(policy, entry, capabilities.backend)
        if note is not None:
            grouped.setdefault((note, entry.why or "no hook on it"), []).append(entry.op)
    return [f"{', '.join(ops)}: {note} ({why})" for (note, why), ops in grouped.items()]
