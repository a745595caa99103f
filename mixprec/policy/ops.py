"""The neutral op vocabulary: the op families, their default list membership, ban advice.

Policies name ops by *family* (``"linear"``, ``"softmax"``), never by a framework's own
name; each backend maps families to its native ops. The vocabulary is closed, so a typo is
an error rather than a rule that silently never fires. A backend may also accept its native
names in rules as ``"<backend>:<native>"`` (``"torch:aten::addmm"``,
``"mxnet:FullyConnected"``); those are checked only for that form.

The default lists follow torch.autocast, apex and mxnet.contrib.amp: matrix products run in
low precision, reductions, exponentials, norms and losses in float32, and elementwise ops
that mix inputs promote to the widest of them. bfloat16 has float32's exponent range, so
the ops kept in float32 only for float16's range (``pow``, ``prod``) pass through under it.
The :class:`~mixprec.policy.rules.OpRules` built from these names live with the presets
(:func:`mixprec.policy.presets.default_op_rules`): this module is vocabulary only.
"""

from __future__ import annotations

import difflib
import re

from mixprec.errors import PolicyError

__all__ = [
    "BANNED_ADVICE",
    "DEFAULT_BANNED",
    "DEFAULT_FP32",
    "DEFAULT_LOWP",
    "DEFAULT_PASSTHROUGH",
    "DEFAULT_PROMOTE",
    "FP16_RANGE_ONLY",
    "OP_FAMILIES",
    "ban_advice",
    "check_op_name",
]

DEFAULT_LOWP: tuple[str, ...] = (
    "linear",
    "matmul",
    "bmm",
    "conv",
    "conv_transpose",
    "attention",
    "rnn_cell",
)
DEFAULT_FP32: tuple[str, ...] = (
    "softmax",
    "log_softmax",
    "exp",
    "log",
    "pow",
    "layer_norm",
    "group_norm",
    "batch_norm",
    "instance_norm",
    "norm",
    "sum",
    "prod",
    "cumsum",
    "logsumexp",
    "cross_entropy",
    "nll_loss",
    "mse_loss",
    "l1_loss",
    "smooth_l1_loss",
    "kl_div",
    "binary_cross_entropy_with_logits",
)
DEFAULT_PROMOTE: tuple[str, ...] = (
    "add",
    "sub",
    "mul",
    "div",
    "cat",
    "stack",
    "addcmul",
    "addcdiv",
    "where",
)
DEFAULT_BANNED: tuple[str, ...] = ("binary_cross_entropy",)
DEFAULT_PASSTHROUGH: tuple[str, ...] = (
    "relu",
    "gelu",
    "silu",
    "sigmoid",
    "tanh",
    "dropout",
    "max_pool",
    "avg_pool",
    "embedding",
)

#: Every neutral op family, in the order of the lists above.
OP_FAMILIES: tuple[str, ...] = (
    *DEFAULT_LOWP,
    *DEFAULT_FP32,
    *DEFAULT_PROMOTE,
    *DEFAULT_BANNED,
    *DEFAULT_PASSTHROUGH,
)
_FAMILIES = frozenset(OP_FAMILIES)

#: Ops kept in float32 only because float16 overflows at 65504.
FP16_RANGE_ONLY: tuple[str, ...] = ("pow", "prod")

#: Why an op is banned by default, and what to use instead.
BANNED_ADVICE: dict[str, str] = {
    "binary_cross_entropy": (
        "binary_cross_entropy on float16 probabilities is unsafe (log(0) once sigmoid saturates); "
        "use binary_cross_entropy_with_logits, which fuses the sigmoid and runs in float32"
    ),
}

_PREFIXED = re.compile(r"^[A-Za-z][A-Za-z0-9_]*:[^\s,|=()\[\]{}\"'#]+$")


def check_op_name(op: str) -> str:
    """Return ``op`` if it is a neutral family or a ``"<backend>:<native>"`` name.

    :raises PolicyError: an unknown neutral name (with the closest families and the full
        vocabulary) or a malformed prefixed name.
    """
    if op in _FAMILIES:
        return op
    if isinstance(op, str) and ":" in op:
        if _PREFIXED.match(op):
            return op
        raise PolicyError(
            f"malformed backend op name {op!r}: write '<backend>:<native name>', such as "
            f"'torch:aten::addmm' or 'mxnet:FullyConnected' (no spaces, commas, '|', '=' or "
            f"brackets)"
        )
    close = difflib.get_close_matches(str(op), OP_FAMILIES, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise PolicyError(
        f"unknown op {op!r}.{hint} Neutral op families: {', '.join(sorted(OP_FAMILIES))}. "
        f"A backend's native op can be named as '<backend>:<name>' ('torch:aten::addmm')."
    )


def ban_advice(op: str) -> str:
    """What to do instead of a banned op (generic advice for ops banned by the user)."""
    return BANNED_ADVICE.get(
        op, f"{op!r} is banned by this policy; move it with policy.with_ops(fp32=[{op!r}])"
    )
