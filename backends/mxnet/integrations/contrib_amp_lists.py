"""``mxnet.contrib.amp``'s ``init`` and op-list functions, as mixprec policies.

``amp.init(target_dtype=...)`` becomes a policy (``O1`` for float16, ``O1-bf16`` for
bfloat16) with the op lists it was given moved as ``"mxnet:<op>"`` rules; nothing in MXNet
is patched. The ``list_*`` functions answer with the lists MXNet's graph pass gets from that
policy on a context (:func:`mixprec_mxnet.ops.amp_lists`): the ops that run in low precision,
in float32, in their widest input type, so they reflect ops this machine has no kernel for
(float32 islands) and the user's own rules, where MXNet's returned fixed tables.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterable, Sequence
from typing import Any

import mxnet as mx
from mxnet.contrib.amp.lists import symbol_bf16, symbol_fp16

from mixprec.errors import PolicyError
from mixprec.kit import BFLOAT16, FLOAT16, Policy, canonical_dtype, get_policy, is_low_precision

from ..devices import device_key
from ..dtypes import dtype_name
from ..ops import FAMILY_OPS, PREFIX, AmpLists, amp_lists

__all__ = [
    "current_policy",
    "init",
    "list_conditional_fp32_ops",
    "list_fp16_fp32_ops",
    "list_fp16_ops",
    "list_fp32_ops",
    "list_loss_output_functions",
    "list_lp16_fp32_ops",
    "list_lp16_ops",
    "list_lp16_use_fp32_params",
    "list_widest_type_cast",
    "policy_for",
    "target_name",
]

Conditional = Sequence[tuple[str, str, Sequence[str]]]


class _State:
    """The policy :func:`init` chose (``None`` until it is called)."""

    policy: Policy | None = None


def init(
    target_dtype: Any = None,
    target_precision_ops: Iterable[str] | None = None,
    conditional_fp32_ops: Conditional | None = None,
    fp32_ops: Iterable[str] | None = None,
    *,
    policy: Any = None,
    **overrides: Any,
) -> Policy:
    """Choose the policy ``amp.init_trainer`` gives trainers; patch nothing.

    :param target_dtype: ``"float16"`` (the default, as in MXNet) or ``"bfloat16"`` (any
        alias, ``numpy.float16`` or MXNet's bfloat16 dtype): policy ``O1`` / ``O1-bf16``.
    :param target_precision_ops, fp32_ops: MXNet op names moved into the low-precision /
        float32 list (MXNet replaced its whole list with them; mixprec moves just these).
    :param conditional_fp32_ops: ``(op, param, values)`` entries to run in float32; each value
        must select a family mixprec knows (``("Activation", "act_type", ["relu"])``) or be
        in MXNet's own conditional list already.
    :param policy: any mixprec policy instead (``"O2-bf16"``: bfloat16 weights, float32
        masters); ``target_dtype``, if given, must agree with its compute dtype.
    :param overrides: policy overrides, e.g. ``loss_scale="dynamic"``.
    :returns: the policy, also :func:`current_policy`. A later call replaces it for trainers
        initialised after it (MXNet ignored every call but the first).
    :raises PolicyError: an unknown dtype or op name, or op lists with an O2/O3 policy.
    """
    chosen = policy_for(
        target_dtype, target_precision_ops, fp32_ops, conditional_fp32_ops, policy, **overrides
    )
    _State.policy = chosen
    return chosen


def current_policy() -> Policy | None:
    """The policy the last :func:`init` chose, or None before it."""
    return _State.policy


def target_name(target_dtype: Any) -> str:
    """``"float16"`` or ``"bfloat16"`` for AMP's ``target_dtype`` (name, numpy or MXNet dtype).

    :raises PolicyError: any other dtype.
    """
    name = canonical_dtype(target_dtype) if isinstance(target_dtype, str) else None
    if name is None:
        try:
            name = dtype_name(target_dtype)
        except TypeError:
            name = repr(target_dtype)
    if name not in (FLOAT16, BFLOAT16):
        raise PolicyError(
            f"AMP's target_dtype is float16 or bfloat16, not {name}; for float32 training "
            "leave amp out, or pass a mixprec policy: amp.init(policy='O0')"
        )
    return name


def policy_for(
    target_dtype: Any,
    lowp_ops: Iterable[str] | None,
    fp32_ops: Iterable[str] | None,
    conditional_fp32_ops: Conditional | None,
    policy: Any = None,
    **overrides: Any,
) -> Policy:
    """The mixprec policy for AMP's arguments (see :func:`init`)."""
    if policy is None:
        target = target_name(FLOAT16 if target_dtype is None else target_dtype)
        chosen = get_policy("O1" if target == FLOAT16 else "O1-bf16", **overrides)
    else:
        chosen = get_policy(policy, **overrides)
        if target_dtype is not None and chosen.is_resolved:
            target = target_name(target_dtype)
            if target != chosen.compute:
                raise PolicyError(
                    f"target_dtype={target} disagrees with policy {chosen.label}, which "
                    f"computes in {chosen.compute}; give one of them"
                )
    lowp = [_native(op) for op in lowp_ops or ()]
    fp32 = [_native(op) for op in fp32_ops or ()]
    fp32 += _conditional_families(conditional_fp32_ops or (), chosen.compute)
    if not (lowp or fp32):
        return chosen
    if is_low_precision(chosen.param):
        raise PolicyError(
            f"op lists move single ops, which policy {chosen.label} cannot do: it casts "
            "parameters and casts at block boundaries. Use an O1 policy with op lists, or pin "
            "blocks with policy.with_module(...) under O2"
        )
    return chosen.with_ops(lowp=lowp, fp32=fp32)


@functools.cache
def _registered_ops() -> frozenset[str]:
    return frozenset(mx.operator.get_all_registered_operators())


def _native(op: str) -> str:
    name = op[len(PREFIX) :] if op.startswith(PREFIX) else op
    if name not in _registered_ops():
        close = difflib.get_close_matches(name, sorted(_registered_ops()), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise PolicyError(
            f"{name!r} is not an MXNet operator{hint}; AMP's op lists take registered "
            "operator names such as 'FullyConnected' or 'softmax'"
        )
    return PREFIX + name


def _mxnet_tables(target: str) -> Any:
    return symbol_bf16 if target == BFLOAT16 else symbol_fp16


def _conditional_families(entries: Conditional, compute: str) -> list[str]:
    """The families the ``(op, param, values)`` entries select; values that select none must
    be in MXNet's own conditional list, which mixprec's graph pass keeps."""
    builtin = {(op, param): set(values) for op, param, values in _tables_conditional(compute)}
    families = []
    for op, param, values in entries:
        for value in values:
            family = next(
                (
                    fam
                    for fam, natives in FAMILY_OPS.items()
                    for native in natives
                    if (native.name, native.param) == (op, param) and value in native.values
                ),
                None,
            )
            if family is not None:
                families.append(family)
            elif value not in builtin.get((op, param), set()):
                raise PolicyError(
                    f"conditional_fp32_ops entry ({op!r}, {param!r}, {value!r}) selects no op "
                    f"family mixprec knows; name the whole op in fp32_ops=['{op}'] instead"
                )
    return families


def _tables_conditional(compute: str) -> list[tuple[str, str, list[str]]]:
    target = compute if compute in (FLOAT16, BFLOAT16) else FLOAT16
    return list(_mxnet_tables(target).CONDITIONAL_FP32_FUNCS)


# ---------------------------------------------------------------------- the op lists


def _lists(target_dtype: Any, ctx: Any) -> AmpLists:
    current = _State.policy
    if target_dtype is None:
        target = current.compute if current is not None and current.is_resolved else FLOAT16
        target = target if target in (FLOAT16, BFLOAT16) else FLOAT16
    else:
        target = target_name(target_dtype)
    if current is not None and current.compute == target and current.casts_ops:
        policy = current
    else:
        policy = get_policy("O1" if target == FLOAT16 else "O1-bf16")
    return amp_lists(policy, device_key(ctx or mx.current_context()))


def list_lp16_ops(target_dtype: Any = None, ctx: Any = None) -> list[str]:
    """MXNet ops the graph pass runs in ``target_dtype`` (default: :func:`init`'s) on ``ctx``
    (default: the current context), under :func:`init`'s policy where its dtype matches."""
    return sorted(_lists(target_dtype, ctx).lowp)


def list_fp32_ops(target_dtype: Any = None, ctx: Any = None) -> list[str]:
    """MXNet ops the graph pass runs in float32, float32 islands on this machine included."""
    return sorted(_lists(target_dtype, ctx).fp32)


def list_widest_type_cast(target_dtype: Any = None, ctx: Any = None) -> list[str]:
    """MXNet ops the graph pass runs in the widest type among their inputs."""
    return sorted(_lists(target_dtype, ctx).widest)


def list_conditional_fp32_ops(
    target_dtype: Any = None, ctx: Any = None
) -> list[tuple[str, str, list[str]]]:
    """``(op, param, values)``: ops run in float32 when ``param`` has one of ``values``."""
    return _lists(target_dtype, ctx).conditional_list()


def list_lp16_fp32_ops(target_dtype: Any = None, ctx: Any = None) -> list[str]:
    """MXNet ops that run in whatever type comes in (none of the other lists)."""
    lists = _lists(target_dtype, ctx)
    tables = _mxnet_tables(lists.target_dtype)
    either = getattr(tables, "BF16_FP32_FUNCS", None) or getattr(tables, "FP16_FP32_FUNCS", [])
    return sorted(set(either) - lists.lowp - lists.fp32 - lists.widest)


def list_loss_output_functions(target_dtype: Any = None) -> list[str]:
    """MXNet's loss-output ops (MXNet scaled their gradients itself; mixprec's ``scale_loss``
    scales every loss, so they need nothing more)."""
    target = target_name(target_dtype) if target_dtype is not None else FLOAT16
    return list(_mxnet_tables(target).LOSS_OUTPUT_FUNCTIONS)


def list_lp16_use_fp32_params(target_dtype: Any = None) -> dict[str, list[str]] | None:
    """Ops whose listed parameters stay float32 under bfloat16 (None for float16), as MXNet's
    table says; mixprec pins BatchNorm's parameters by its own module rule."""
    target = target_name(target_dtype) if target_dtype is not None else FLOAT16
    if target == FLOAT16:
        return None
    return dict(symbol_bf16.BF16_USE_FP32_PARAMS)


#: MXNet 1.5's names for the same lists.
list_fp16_ops = list_lp16_ops
"""MXNet's older name of :func:`list_lp16_ops` (the same function)."""
list_fp16_fp32_ops = list_lp16_fp32_ops
"""MXNet's older name of :func:`list_lp16_fp32_ops` (the same function)."""
