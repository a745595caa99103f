"""Writes users make to a wrapped model between steps, carried into the masters (O2 idioms).

Under O2 the optimizer updates float32 masters and each step copies them into the model
(:mod:`mixprec_torch.step.protocol`, step 7). Two everyday idioms write to the *model* instead,
and without this module the step would silently undo them:

- **weight surgery after wrap** (re-initialising a head, ``p.copy_(...)`` under
  ``torch.no_grad()``, hand-loaded weights): the next step would copy the stale master over
  it, even at ``lr=0``. PyTorch bumps a tensor's version counter on every in-place write, so
  the counter of each model parameter is recorded whenever mixprec itself last wrote it
  (wrap, the master copy after a step). Before a step, a parameter whose counter moved *and*
  whose value no longer equals its master rounded to its dtype was edited: its master takes
  the new value (:func:`refresh_edited_masters`). The value check keeps the exact float32
  master when a write put the same values back (a checkpoint load, DDP's initial broadcast
  between identically seeded ranks). Reading the counters is one list of integers per
  step, compared with the list kept after the last master copy; the value check runs only
  for parameters whose counter moved.
- **clipping the model's gradients after** ``unscale_``
  (``clip_grad_norm_(model.parameters(), c)``, Lightning and Accelerate hooks that only know
  the model): ``unscale_`` has already cast the gradients into the masters, which the
  optimizer applies, so the clip would change nothing it uses. A model parameter's ``.grad``
  cannot be a view of the float32 master gradient (PyTorch requires the parameter's dtype),
  so the cheapest correct design is to make the model gradients hold the unscaled values
  (:func:`expose_unscaled_grads`: nothing to copy without loss scaling, one fused copy with
  it) and to record their version counters; at the step, every model gradient written since
  is copied into its master's gradient (:func:`take_grad_edits`). Such a clip carries one
  rounding to the parameter's dtype, like the gradient itself; clipping
  ``master_params(optimizer)`` instead clips the float32 values and copies nothing.
"""

from __future__ import annotations

import torch

from ..torch_private import foreach_copy_, sole_owner, tensor_version, tensor_versions
from .optimizer_state import Layout, OptimizerState, SpareGrad, WrapGroup

__all__ = [
    "cast_grads_into",
    "expose_unscaled_grads",
    "grad_buffers",
    "held_grads",
    "keep_dropped_grads",
    "mark_copied",
    "record_param_versions",
    "refresh_edited_masters",
    "take_grad_edits",
]


def record_param_versions(group: WrapGroup, params: list[torch.Tensor]) -> None:
    """At wrap: note the version counters of ``params`` once they are cast."""
    group.param_versions.update(zip(map(id, params), tensor_versions(params), strict=True))


def refresh_edited_masters(group: WrapGroup, lay: Layout) -> int:
    """Copy into its master every model parameter of ``lay`` written since mixprec last wrote
    it, unless it still holds its master's rounded value; return how many masters took a new
    value.

    The common case (nothing edited) is one list of counters compared with the list kept
    after the last master copy (:attr:`Layout.versions`); the wrap-time record serves until
    the first step of the layout.
    """
    params = lay.params
    now = tensor_versions(params)
    kept = lay.versions
    if kept == now:
        return 0
    marks: list[int | None] = list(kept) if kept is not None and len(kept) == len(now) else []
    if not marks:
        marks = [group.param_versions.get(id(p)) for p in params]
    refreshed = 0
    with torch.no_grad():
        for param, master, mark, version in zip(params, lay.masters, marks, now, strict=True):
            if mark == version:
                continue
            if param.shape == master.shape and not torch.equal(master.to(param.dtype), param):
                master.copy_(param)
                refreshed += 1
    lay.versions = now
    return refreshed


def mark_copied(lay: Layout) -> None:
    """After the master copy: the counters a later user edit will move."""
    lay.versions = tensor_versions(lay.params)


def expose_unscaled_grads(
    st: OptimizerState, params: list[torch.Tensor], masters: list[torch.Tensor]
) -> None:
    """After ``unscale_``: give the model gradients the unscaled values the masters hold and
    mark them, so a clip of the model's gradients reaches the masters at the step."""
    pairs = [
        (p.grad, m.grad)
        for p, m in zip(params, masters, strict=True)
        if p.grad is not None and m.grad is not None and not p.grad.is_sparse
    ]
    if st.group.scaler.enabled and pairs:
        # with a scale the model gradients still hold scaled values: write the unscaled ones
        with torch.no_grad():
            foreach_copy_([g for g, _ in pairs], [m for _, m in pairs])
    grads = [p.grad for p in params]
    st.iteration.grad_marks = (grads, tensor_versions([g for g in grads if g is not None]))


def take_grad_edits(
    st: OptimizerState, params: list[torch.Tensor], masters: list[torch.Tensor]
) -> None:
    """Copy every model gradient written since :func:`expose_unscaled_grads` into its
    master's gradient (what the optimizer applies); forget the marks."""
    it = st.iteration
    marks, it.grad_marks = it.grad_marks, None
    if marks is None:
        return
    grads, versions = marks
    seen = iter(versions)
    edited: list[torch.Tensor | None] = []
    into: list[torch.Tensor] = []
    for param, master, marked in zip(params, masters, grads, strict=True):
        version = next(seen) if marked is not None else None
        grad = param.grad
        if grad is marked and (grad is None or tensor_version(grad) == version):
            continue  # untouched since unscale_
        edited.append(grad)
        into.append(master)
    cast_grads_into(edited, into, st.spare_grads)


def cast_grads_into(
    grads: list[torch.Tensor | None],
    masters: list[torch.Tensor],
    spare: dict[int, SpareGrad] | None = None,
) -> None:
    """Cast each gradient into its master's ``.grad``: None clears it, a sparse one is
    converted, the dense ones go through one fused copy into buffers allocated once. A
    master whose gradient ``zero_grad(set_to_none=True)`` dropped gets it back in the memory
    it had (``spare``, see :func:`keep_dropped_grads`) when nothing else holds that memory."""
    dst, src = grad_buffers(grads, masters, spare)
    if dst:
        with torch.no_grad():
            foreach_copy_(dst, src)


def grad_buffers(
    grads: list[torch.Tensor | None],
    masters: list[torch.Tensor],
    spare: dict[int, SpareGrad] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """What :func:`cast_grads_into` copies, without copying: (the masters' gradient buffers,
    the dense gradients to write into them). None gradients clear their master's, sparse
    ones are converted here."""
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    for grad, master in zip(grads, masters, strict=True):
        if grad is None or grad.is_sparse:
            master.grad = None if grad is None else grad.to(master.dtype)
            continue
        if master.grad is None or master.grad.shape != master.shape:
            kept = _spare_grad(spare, master) if spare else None
            master.grad = torch.empty_like(master) if kept is None else kept
        dst.append(master.grad)
        src.append(grad)
    return dst, src


def held_grads(masters: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(master, its gradient) for every dense float32 master gradient the cast could reuse:
    taken before ``zero_grad`` drops them."""
    held = []
    for master in masters:
        grad = master.grad
        if (
            grad is not None
            and not grad.is_sparse
            and not grad.requires_grad
            and grad.dtype == master.dtype
            and grad.shape == master.shape
            and grad.device == master.device
        ):
            held.append((master, grad))
    return held


def keep_dropped_grads(
    spare: dict[int, SpareGrad], held: list[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """After ``zero_grad``: keep the memory of each held gradient that is gone from its master
    now (``set_to_none=True``), for the next cast into that master. The master's ``.grad``
    stays None, as PyTorch users expect; only the storage is kept, so a gradient tensor the
    user still holds is never written (:func:`_spare_grad` checks)."""
    for master, grad in held:
        if master.grad is None:
            spare[id(master)] = (
                grad.untyped_storage(),
                grad.dtype,
                int(grad.storage_offset()),
                tuple(grad.shape),
                grad.stride(),
            )


def _spare_grad(spare: dict[int, SpareGrad], master: torch.Tensor) -> torch.Tensor | None:
    """A gradient for ``master`` over its kept memory; None when none is kept, or when the
    memory is still referenced elsewhere (a tensor or view the user kept, an autograd graph):
    writing it would change what they hold."""
    kept = spare.pop(id(master), None)
    if kept is None:
        return None
    storage, dtype, offset, shape, stride = kept
    if (
        dtype != master.dtype
        or shape != tuple(master.shape)
        or storage.device != master.device
        or not sole_owner(storage)
    ):
        return None
    return torch.empty(0, dtype=dtype, device=master.device).set_(storage, offset, shape, stride)
