"""The Gluon step on MXNet's multi-tensor kernels: one op for many arrays where MXNet has one.

Issue 34. Per step and context, where the per-parameter path ran one MXNet op per parameter:

- the overflow check (:func:`count_nonfinite`): ``multi_sum_sq`` (the sum of squares of
  every master gradient under 32768 elements, one op), a BLAS ``dot`` for each larger one
  (faster than ``multi_sum_sq`` there), their sum and ``all_finite``, where the
  per-parameter check ran a ``dot`` for every gradient. The decision is the same as
  :func:`~.protocol.count_nonfinite`'s: unsafe when any square is inf or NaN or their float32
  sum overflows (``multi_sum_sq`` sums in float32 like ``dot``; the order of the sum differs,
  so a sum within a rounding of float32's largest value may fall either way in either);
- the casts model gradient -> master gradient and master -> model weight
  (:func:`cast_pairs`): one ``amp_multicast`` per (context, source dtype, target dtype), its
  outputs written in place (``out=``); a one-element anchor input in the target dtype makes
  it widen (or, with ``cast_narrow``, narrow) every array to that dtype. Rounding: the same
  kernel as ``amp_cast`` (nearest-even), so bit for bit the per-parameter casts. On the CPU,
  between float32 and bfloat16, ``Cast`` and float32 ops cast the arrays of 32768 elements
  or more instead, with the same bits at about a tenth of the cost (:mod:`..bf16_rounding`;
  ``amp_multicast`` where they cannot);
- the optimizer over the float32 masters (:func:`update`): ``multi_sgd_update``,
  ``multi_sgd_mom_update``, ``contrib.multi_adamw_update`` (mixprec's ``"adamw"``) and
  ``contrib.multi_lamb_update``, in chunks the kernels take (their parameter structs hold 45
  to 60 arrays and are not bounds-checked), with per-array learning rates and weight decays
  (``lr_mult``/``wd_mult`` included). The optimizer state is the updater's own
  (``updater.states``, made by the optimizer's ``create_state_multi_precision`` as Gluon's
  updater makes it), so ``save_states``/``load_states`` and a switch between the paths
  see one state.

Equivalence with the per-parameter path (``MIXPREC_MXNET_MULTI_TENSOR=0``):

- SGD, SGD momentum and LAMB: bit for bit (the per-parameter path is Gluon's updater, which
  already runs these very kernels, four (SGD) or 45 (LAMB) arrays at a time; the kernels are
  elementwise per array);
- AdamW: to float32 rounding. The multi kernel updates the moments as
  ``beta1 * (m - g) + g`` where ``contrib.adamw_update`` computes ``beta1 * m + (1 - beta1) *
  g``; the weight update is the same expression. (``contrib.adamw_update`` also rescales the
  gradient array in place; the multi kernel leaves it.)
- Adam: MXNet has no multi-tensor Adam. ``multi_adamw_update`` cannot carry Adam's coupled
  weight decay (added to the gradient before the moments), and even with ``wd=0`` its moment
  update rounds differently from ``adam_update``'s, so Adam stays one ``adam_update`` per
  parameter (Gluon's updater).
- Any other optimizer, a subclass of these, non-float32 weights, sparse arrays or NumPy-mode
  arrays: Gluon's updater, as before.

Switch: ``MIXPREC_MXNET_MULTI_TENSOR=0`` in the environment (read at every step) keeps the
per-parameter path everywhere, for comparison.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import mxnet as mx
import numpy as np
from mxnet import nd

from mixprec.kit import FLOAT32

from ..bf16_rounding import from_bf16_into, splittable, to_bf16_into
from ..dtypes import cast, cast_into
from .optimizers import AdamW

__all__ = [
    "ENV",
    "cast_pairs",
    "count_nonfinite",
    "enabled",
    "supported",
    "update",
]

#: The environment switch: ``"0"`` keeps the per-parameter path.
ENV = "MIXPREC_MXNET_MULTI_TENSOR"

_F32 = np.dtype(np.float32)
#: Arrays of at least this many elements keep a BLAS ``dot`` each in the overflow check.
DOT_FROM = 1 << 15
#: Arrays per op: the kernels' parameter structs hold at most 60 (SGD), 50 (AdamW) and 45
#: (LAMB) arrays, unchecked; 45 stays under every one of them.
_SGD_CHUNK = 50
_ADAMW_CHUNK = 50
_LAMB_CHUNK = 45
#: The dtypes ``amp_multicast`` casts between.
_MULTICAST = {"float16", "bfloat16", "float32"}


def enabled() -> bool:
    """Whether the multi-tensor path is on (``MIXPREC_MXNET_MULTI_TENSOR`` is not ``0``)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


# ---------------------------------------------------------------------- the overflow check


def count_nonfinite(arrays: Sequence[nd.NDArray]) -> nd.NDArray:
    """1 when ``arrays`` (one context's) are unsafe to apply, else 0, as
    :func:`~.protocol.count_nonfinite` decides it: an inf or NaN element gives an inf or NaN
    square sum, and so does a sum beyond float32's range.

    The arrays under :data:`DOT_FROM` elements go through one ``multi_sum_sq``; larger ones
    keep their BLAS ``dot`` each, which streams a large array about 3 times faster than
    ``multi_sum_sq`` (4 x 2048² float32: 5.7 against 16.7 ms, one AVX2 thread), so the op
    count falls where per-op overhead dominates (biases, BatchNorm, small layers) and the
    large gradients lose no bandwidth."""
    floats = [a if a.dtype == _F32 else cast(a, FLOAT32) for a in arrays]
    small = [a for a in floats if a.size < DOT_FROM]
    squares = [nd.dot(flat, flat).reshape((1,)) for flat in _flat_large(floats)]
    if small:
        squares.append(nd.multi_sum_sq(*small, num_arrays=len(small)))
    total = nd.concat(*squares, dim=0) if len(squares) > 1 else squares[0]
    return 1 - nd.all_finite(nd.sum(total))


def _flat_large(floats: Sequence[nd.NDArray]) -> list[nd.NDArray]:
    return [a.reshape((-1,)) for a in floats if a.size >= DOT_FROM]


# ---------------------------------------------------------------------- casts


_anchors: dict[tuple[str, str], tuple[nd.NDArray, nd.NDArray]] = {}


def _anchor(ctx: mx.Context, dtype: Any) -> tuple[nd.NDArray, nd.NDArray]:
    """A one-element (input, output) pair in ``dtype`` on ``ctx``: the anchor that makes
    ``amp_multicast`` cast to ``dtype``."""
    key = (str(ctx), str(np.dtype(dtype)))
    pair = _anchors.get(key)
    if pair is None:
        zero = nd.zeros((1,), ctx=ctx)
        pair = (cast(zero, _name(dtype)), cast(zero.copy(), _name(dtype)))
        _anchors[key] = pair
    return pair


def _name(dtype: Any) -> str:
    dt = np.dtype(dtype)
    return "bfloat16" if dt.names == ("bfloat16",) or str(dt) == "bfloat16" else str(dt)


def cast_pairs(pairs: Sequence[tuple[nd.NDArray, nd.NDArray]]) -> None:
    """Write each ``source`` into its ``target`` (``(source, target)`` pairs), rounding to
    nearest-even as :func:`~..dtypes.cast_into`: one ``amp_multicast`` per (context,
    source dtype, target dtype) group of float16/bfloat16/float32 arrays, ``cast_into``
    for the rest (a copy where the dtypes agree)."""
    groups: dict[tuple[str, str, str], list[tuple[nd.NDArray, nd.NDArray]]] = {}
    for src, dst in pairs:
        if src is dst:
            continue
        s, d = _name(src.dtype), _name(dst.dtype)
        if s == d or s not in _MULTICAST or d not in _MULTICAST:
            cast_into(src, dst)
            continue
        groups.setdefault((str(src.context), s, d), []).append((src, dst))
    for (ctx, s, d), group in groups.items():
        if ctx.startswith("cpu"):
            group = _fast_bf16(s, d, group)
        if not group:
            continue
        if len(group) == 1:
            cast_into(*group[0])
            continue
        srcs, dsts = zip(*group, strict=True)
        anchor_in, anchor_out = _anchor(dsts[0].context, dsts[0].dtype)
        narrow = _MULTICAST_ORDER[d] < _MULTICAST_ORDER[s]
        nd.amp_multicast(
            *srcs,
            anchor_in,
            num_outputs=len(srcs) + 1,
            cast_narrow=narrow,
            out=[*dsts, anchor_out],
        )


_MULTICAST_ORDER = {"float16": 0, "bfloat16": 0, "float32": 1}

#: arrays from this size are cast between float32 and bfloat16 by float32 ops on the CPU:
#: below it one ``amp_multicast`` for all costs less than a few ops per array
FAST_CAST_SIZE = 32768


def _fast_bf16(
    source: str, target: str, group: list[tuple[nd.NDArray, nd.NDArray]]
) -> list[tuple[nd.NDArray, nd.NDArray]]:
    """Cast the arrays of a CPU group of :data:`FAST_CAST_SIZE` elements or more between
    float32 and bfloat16 with ``Cast`` and float32 ops, with ``amp_multicast``'s bits at
    about a tenth of its cost on a CPU without bfloat16 instructions (:mod:`..bf16_rounding`);
    the pairs left to ``amp_multicast`` (smaller arrays, other dtypes, values too large)."""
    if (source, target) not in (("bfloat16", "float32"), ("float32", "bfloat16")):
        return group
    large = [(s, d) for s, d in group if s.size >= FAST_CAST_SIZE]
    if not large:
        return group
    if source == "bfloat16":
        for src, dst in large:
            from_bf16_into(src, dst)
    elif splittable([s for s, _ in large]):
        for src, dst in large:
            to_bf16_into(src, dst)
    else:
        return group
    return [(s, d) for s, d in group if s.size < FAST_CAST_SIZE]


# ---------------------------------------------------------------------- the optimizer


def supported(optimizer: Any) -> str | None:
    """The multi-tensor kind of ``optimizer`` (``"sgd"``, ``"adamw"``, ``"lamb"``), or None
    where it has none (Adam, any other optimizer or subclass: Gluon's updater)."""
    kind = type(optimizer)
    if kind is mx.optimizer.SGD:
        return "sgd"
    if kind is AdamW:
        return "adamw"
    if kind is mx.optimizer.LAMB:
        return "lamb"
    return None


def update(
    updater: Any,
    indices: Sequence[int],
    grads: Sequence[nd.NDArray],
    weights: Sequence[nd.NDArray],
) -> None:
    """One context's update of ``weights`` by ``grads`` (Gluon's ``updater(indices, grads,
    weights)``): through the multi-tensor kernels where the optimizer and the arrays allow,
    else through ``updater`` itself."""
    optimizer = updater.optimizer
    kind = supported(optimizer) if enabled() else None
    if kind is None or not _plain(grads, weights):
        updater(list(indices), list(grads), list(weights))
        return
    optimizer._set_current_context(weights[0].context.device_id)
    states = _states(updater, indices, weights)
    if kind == "sgd":
        _sgd(optimizer, indices, grads, weights, states)
    elif kind == "adamw":
        _adamw(optimizer, indices, grads, weights, states)
    else:
        _lamb(optimizer, indices, grads, weights, states)


def _plain(grads: Sequence[nd.NDArray], weights: Sequence[nd.NDArray]) -> bool:
    """Dense float32 NDArrays (not NumPy-mode, not sparse): what the kernels take here."""
    return all(
        type(a) is nd.NDArray and a.stype == "default" and a.dtype == _F32
        for a in (*grads, *weights)
    )


def _states(updater: Any, indices: Sequence[int], weights: Sequence[nd.NDArray]) -> list[Any]:
    """The updater's state of each index, made or moved to the weight's context as Gluon's
    ``Updater.__call__`` does."""
    optimizer = updater.optimizer
    for idx, weight in zip(indices, weights, strict=True):
        if idx not in updater.states:
            updater.states[idx] = optimizer.create_state_multi_precision(idx, weight)
            updater.states_synced[idx] = True
        elif not updater.states_synced[idx]:
            updater.states[idx] = updater.sync_state_context(updater.states[idx], weight.context)
            updater.states_synced[idx] = True
    return [updater.states[idx] for idx in indices]


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _counted(optimizer: Any, indices: Sequence[int]) -> tuple[list[float], list[float]]:
    """Count one update of every index, then their learning rates and weight decays (as
    MXNet's SGD does for each aggregate)."""
    optimizer._update_count(list(indices))
    lrs = [float(lr) for lr in optimizer._get_lrs(list(indices))]
    wds = [float(wd) for wd in optimizer._get_wds(list(indices))]
    return lrs, wds


def _sgd(
    optimizer: Any,
    indices: Sequence[int],
    grads: Sequence[nd.NDArray],
    weights: Sequence[nd.NDArray],
    states: Sequence[Any],
) -> None:
    lrs, wds = _counted(optimizer, indices)
    kwargs: dict[str, Any] = {"rescale_grad": optimizer.rescale_grad}
    momentum = optimizer.momentum > 0
    if momentum:
        kwargs["momentum"] = optimizer.momentum
    if optimizer.clip_gradient:
        kwargs["clip_gradient"] = optimizer.clip_gradient
    for part in _chunks(len(weights), _SGD_CHUNK):
        w, g, n = list(weights[part]), list(grads[part]), len(weights[part])
        if momentum:
            flat = [a for trio in zip(w, g, states[part], strict=True) for a in trio]
            nd.multi_sgd_mom_update(
                *flat, out=w, num_weights=n, lrs=lrs[part], wds=wds[part], **kwargs
            )
        else:
            flat = [a for pair in zip(w, g, strict=True) for a in pair]
            nd.multi_sgd_update(*flat, out=w, num_weights=n, lrs=lrs[part], wds=wds[part], **kwargs)


_rescales: dict[tuple[str, float], nd.NDArray] = {}


def _rescale_array(ctx: mx.Context, value: float) -> nd.NDArray:
    """``rescale_grad`` as the one-element float32 array the AdamW kernel reads, cached per
    (context, value): a fixed batch size and loss scale cost no op per step."""
    key = (str(ctx), value)
    array = _rescales.get(key)
    if array is None:
        if len(_rescales) > 64:
            _rescales.clear()
        array = nd.full((1,), value, ctx=ctx, dtype="float32")
        _rescales[key] = array
    return array


def _adamw(
    optimizer: AdamW,
    indices: Sequence[int],
    grads: Sequence[nd.NDArray],
    weights: Sequence[nd.NDArray],
    states: Sequence[Any],
) -> None:
    # per index, as AdamW.update counts: the update count, then lr and wd, then t
    etas, wds, corrections = [], [], []
    for idx in indices:
        optimizer._update_count(idx)
        t = optimizer._index_update_count[idx]
        etas.append(float(optimizer._get_lr(idx)))
        wds.append(float(optimizer._get_wd(idx)))
        corrections.append(math.sqrt(1.0 - optimizer.beta2**t) / (1.0 - optimizer.beta1**t))
    clip = optimizer.clip_gradient if optimizer.clip_gradient is not None else -1.0
    rescale = _rescale_array(weights[0].context, float(optimizer.rescale_grad))
    for part in _chunks(len(weights), _ADAMW_CHUNK):
        means, variances = zip(*states[part], strict=True)
        w = list(weights[part])
        nd.contrib.multi_adamw_update(
            w,
            list(grads[part]),
            list(means),
            list(variances),
            rescale,
            corrections[part],
            wds[part],
            etas[part],
            out=w,
            beta1=optimizer.beta1,
            beta2=optimizer.beta2,
            epsilon=optimizer.epsilon,
            clip_gradient=clip,
        )


def _lamb(
    optimizer: Any,
    indices: Sequence[int],
    grads: Sequence[nd.NDArray],
    weights: Sequence[nd.NDArray],
    states: Sequence[Any],
) -> None:
    # as MXNet's LAMB counts each index, then reads its step, lr and wd
    steps, lrs, wds = [], [], []
    for idx in indices:
        optimizer._update_count(idx)
        steps.append(optimizer._index_update_count[idx])
        lrs.append(optimizer._get_lr(idx))
        wds.append(optimizer._get_wd(idx))
    kwargs: dict[str, Any] = {
        "beta1": optimizer.beta1,
        "beta2": optimizer.beta2,
        "epsilon": optimizer.epsilon,
        "bias_correction": optimizer.bias_correction,
        "rescale_grad": optimizer.rescale_grad,
    }
    if optimizer.clip_gradient:
        kwargs["clip_gradient"] = optimizer.clip_gradient
    if optimizer.lower_bound:
        kwargs["lower_bound"] = optimizer.lower_bound
    if optimizer.upper_bound:
        kwargs["upper_bound"] = optimizer.upper_bound
    for part in _chunks(len(weights), _LAMB_CHUNK):
        means, variances = zip(*states[part], strict=True)
        w = list(weights[part])
        nd.contrib.multi_lamb_update(
            w,
            list(grads[part]),
            list(means),
            list(variances),
            out=w,
            step_count=steps[part],
            lrs=lrs[part],
            wds=wds[part],
            **kwargs,
        )
