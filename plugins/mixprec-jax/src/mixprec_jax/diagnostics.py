"""``explain`` and ``dtype_report`` for the JAX backend: the core's, plus what JAX hides.

Both print what the core prints for every backend (:meth:`mixprec.Policy.explain`,
:func:`mixprec.diagnostics.format_dtype_report`) and then the lines of
:func:`mixprec.visibility.unseen_notes`: the rules that are only JAX's own behaviour,
because the plugin cannot see the op (``x + y``), and bans it cannot enforce.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from mixprec.kit import Policy, dtype_rows, format_dtype_report, unseen_notes
from mixprec_jax.casting import PyTree, dtype_name
from mixprec_jax.devices import capabilities
from mixprec_jax.intercept import FUNCTION_FAMILIES, MODULE_FAMILIES
from mixprec_jax.trees import Modules, leaf_names, module_of

__all__ = ["dtype_report", "explain", "how_seen"]


def how_seen(op: str) -> str | None:
    """How the plugin sees ``op``: the flax classes and functions that are it, or None."""
    classes = sorted(c for c, family in MODULE_FAMILIES.items() if family == op)
    names = [n.replace(":", ".") for n in FUNCTION_FAMILIES.get(op, ())]
    if op == "bmm":
        names = [n.replace(":", ".") for n in FUNCTION_FAMILIES["matmul"]]
    parts = ([f"flax modules {', '.join(classes)}"] if classes else []) + (
        [f"calls of {', '.join(names)}"] if names else []
    )
    return " and ".join(parts) or None


def explain(
    policy: Policy,
    op: str,
    input_dtypes: Sequence[str] = (),
    module: str | None = None,
    module_class: str | Sequence[str] | None = None,
) -> str:
    """The policy's chain for ``op``, then whether and how the JAX backend applies it.

    Example::

        import mixprec
        import mixprec.jax as mpj

        text = mpj.explain(mixprec.get_policy("O1-bf16"), "softmax", ["bfloat16"])
        assert "Result: float32" in text  # O1 keeps softmax in float32
        assert text.endswith("jax: applies this rule to calls of jax.nn.softmax, "
                             "flax.linen.softmax")
    """
    text = policy.explain(op, tuple(input_dtypes), module=module, module_class=module_class)
    caps = capabilities()
    entry = caps.unseen(op)
    if entry is not None:
        notes = unseen_notes(policy, caps, [op])
        said = notes[0] if notes else f"{op}: runs as {entry.native}, as the policy says"
        return f"{text}\njax: cannot see {op!r}. {said}"
    seen = how_seen(op)
    if seen is None:
        return f"{text}\njax: {op!r} is not mapped to a JAX op; nothing applies this rule"
    return f"{text}\njax: applies this rule to {seen}"


def dtype_report(policy: Policy, weights: PyTree, modules: Modules | None) -> str:
    """Each module that owns parameters: their dtype as the forward pass reads them, the
    dtype it computes in, and why; then the rules the plugin cannot apply."""
    own: dict[str, list[Any]] = {}
    for name, leaf in zip(leaf_names(weights), jax.tree_util.tree_leaves(weights), strict=True):
        own.setdefault(module_of(name), []).append(leaf)
    rows_in = []
    for path in sorted(own):
        classes = tuple(modules.get(path, ())) if modules is not None else ()
        dtype = policy.param_dtype_for(path, classes or None)
        rows_in.append((path, classes or ("?",), dtype))
    report = format_dtype_report(dtype_rows(policy, rows_in))
    notes = unseen_notes(policy, capabilities())
    if modules is None:
        notes.insert(0, "module classes unknown (no step traced yet): class rules not shown")
    kept = ", ".join(sorted({dtype_name(x) for x in jax.tree_util.tree_leaves(weights)}))
    footer = [f"the optimizer keeps: {policy.describe_master()} ({kept})"]
    footer += [f"jax: {n}" for n in notes]
    return report + "\n" + "\n".join(footer)
