"""The Gluon Trainer's refusals and warnings about what it was given, before it changes
anything (the torch backend's ``planning.py`` plays the same part for ``wrap``)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

from mxnet import gluon

from mixprec.errors import MixprecWarning, WrapError
from mixprec.kit import (
    BFLOAT16,
    KAHAN,
    STOCHASTIC,
    Policy,
    is_low_precision,
    parse_state_format,
)

from ..blocks import BlockTree
from ..dtypes import dtype_name
from ..gluon_private import dense_embedding_grad, is_deferred, is_sparse
from ..ops import island_natives

__all__ = [
    "check_dense",
    "check_parameters",
    "check_shaped",
    "check_state",
    "densify_embeddings",
    "shape_refusal",
    "sparse_embeddings",
    "warn_params_only",
]


def check_shaped(plan: Sequence[tuple[gluon.Parameter, str]]) -> None:
    """Refuse parameters (no net) that still wait for their shapes and must be cast."""
    if any(is_deferred(p) and dtype != dtype_name(p.dtype) for p, dtype in plan):
        raise WrapError(
            "some parameters have no shape yet (deferred initialisation) and the Trainer "
            "got parameters, not the net, so it cannot see the first forward pass that "
            "gives them their shapes. Pass the net itself (Trainer(net, ...)), give the "
            "layers their input sizes (in_units=, in_channels=), or run one forward pass "
            "before building the Trainer"
        )


def shape_refusal(net: gluon.Block | None, args: Sequence[Any], err: Exception) -> str:
    shapes = ", ".join(str(getattr(a, "shape", type(a).__name__)) for a in args)
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    why = next((line for line in reversed(lines) if "Error" in line or "failed" in line), "")
    return (
        f"the first forward pass of {type(net).__name__} got inputs of shape {shapes}, which "
        f"do not fit the net, so its deferred parameter shapes cannot be inferred ("
        f"{(why or (lines[-1] if lines else type(err).__name__))[:300]}). Nothing was "
        "initialised: call the net again with inputs of the shape it is built for"
    )


def check_state(policy: Policy) -> None:
    """Refuse a ``state`` the Gluon Trainer cannot keep. ``state=bfloat16`` is kept under
    the compensated strategies (``master=kahan|stochastic``, which the policy already
    requires of it; ``StateRounding`` in :mod:`~mixprec_mxnet.compensated.compensation`); a
    low-bit ``state`` (``int8``, ``int4``, ``fp8``) is kept as codes between steps
    (:mod:`~mixprec_mxnet.lowbit`). Anything else (a policy built around the policy's own
    checks) is refused, naming what works."""
    state = policy.state
    if state is None or parse_state_format(state) is not None:
        return
    if state == BFLOAT16 and policy.master_strategy in (KAHAN, STOCHASTIC):
        return
    raise WrapError(
        f"policy {policy.label} keeps the optimizer state in {state} between steps, which "
        "the Gluon Trainer supports only as state=bfloat16 under a compensated strategy "
        "(master=kahan or master=stochastic: 'O3-bf16-kahan,state=bfloat16', "
        "'O3-bf16-sr,state=bfloat16') or as a low-bit format (state=int8, int4 or fp8). "
        f"Use one of those, or drop the item (policy='{_without_state(policy)!s}')"
    )


def _without_state(policy: Policy) -> Policy:
    return dataclasses.replace(policy, state=None, name=None)


def check_parameters(values: Sequence[Any], given: str) -> None:
    if not values:
        raise WrapError(
            f"Trainer got no parameters (the {given} it was given has none to train); pass a "
            "net with layers (Trainer(net, ...), add layers before creating it) or its "
            "collect_params()"
        )
    wrong = [type(v).__name__ for v in values if not isinstance(v, gluon.Parameter)]
    if wrong:
        raise WrapError(
            f"Trainer got {wrong[0]} objects where gluon.Parameter objects belong (arrays hold "
            "values, not the parameters an optimizer updates); pass the net itself "
            "(Trainer(net, ...)) or net.collect_params()"
        )


def check_dense(params: Sequence[gluon.Parameter]) -> None:
    sparse = [p.name for p in params if is_sparse(p)]
    if sparse:
        raise WrapError(
            f"sparse parameters or gradients ({', '.join(sparse[:3])}) need "
            "update_on_kvstore=True in Gluon, which mixprec cannot use; use dense storage"
        )


def sparse_embeddings(tree: BlockTree | None) -> set[int]:
    """ids of the weights of the walked net's ``Embedding(sparse_grad=True)`` layers."""
    if tree is None:
        return set()
    found = set()
    for info in tree.blocks:
        block = info.block
        if isinstance(block, gluon.nn.Embedding) and is_sparse(block.weight):
            found.add(id(block.weight))
    return found


def densify_embeddings(tree: BlockTree) -> None:
    switched = [
        info.path or type(info.block).__name__
        for info in tree.blocks
        if isinstance(info.block, gluon.nn.Embedding) and dense_embedding_grad(info.block)
    ]
    if switched:
        warnings.warn(
            f"Embedding(sparse_grad=True) at {', '.join(switched)}: mixprec trains it with dense "
            "gradients (the same updates, more memory), because Gluon's sparse gradients need "
            "update_on_kvstore=True, where an overflowed step cannot be skipped. Pass "
            "sparse_grad=False to silence this",
            MixprecWarning,
            stacklevel=4,
        )


def warn_params_only(policy: Policy) -> None:
    left_out = []
    if policy.casts_ops:
        left_out.append("op casting (O1 casts ops inside the hybridized net)")
    if is_low_precision(policy.param):
        left_out.append(
            f"casting the net's inputs to {policy.compute} and outputs to {policy.output}, and "
            "class-based module rules such as BatchNorm's"
        )
    islands = sorted(island_natives(policy.compute, "cpu")) if policy.compute == BFLOAT16 else []
    if islands:
        left_out.append(
            f"float32 islands for {', '.join(islands)} (no bfloat16 kernel on this CPU: cast "
            "around them yourself)"
        )
    if left_out:
        warnings.warn(
            f"Trainer got parameters, not the net, so policy {policy.label} cannot apply "
            f"{' or '.join(left_out)}. Pass the net itself: Trainer(net, ...)",
            MixprecWarning,
            stacklevel=3,
        )
