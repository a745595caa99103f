"""The step protocol of DESIGN, top to bottom, for wrapped PyTorch optimizers.

1. **scale the loss** (:func:`scaled_loss`, inside ``scale_loss``): float32, times the scale;
2. **backward**: the user's ``scaled.backward()``;
3. **unscale** (:func:`unscale`, from ``unscale_`` or the round): model gradients are cast
   into the float32 masters' gradients, then one fused unscale-and-check per (device, dtype),
   or one native pass for all of them on the CPU;
4. **found_inf, reduced across ranks** (:func:`reduce_found_inf`): the step's one host sync;
5. **skip or step** (:func:`step`, the patched ``optimizer.step``);
6. **scale update**: once per round, in :func:`open_round`;
7. **copy masters into model params** (:func:`copy_masters_to_model`) after a real step;
   under ``master=kahan|stochastic`` the group's
   :class:`~mixprec_torch.compensated.compensation.Compensation` fills float32 working masters
   before the optimizer's own update and rounds them back into bfloat16 after it (or runs
   the fused update, which does all of it in one pass);
8. **overflow records**: on a skip only, the names of the overflowing parameters are recorded
   before the scaler hears of it (:func:`mixprec_torch.step.diagnostics.record_overflows`), so
   skip hooks can already ask for them.

One ``optimizer.step()`` is :func:`step`: the round (:func:`open_round`: the guard pass of
each member, 3, then 4, 8 and 6) unless another optimizer's step opened it, the update
(:func:`_update`, 5 and 7), and the end of the iteration (:func:`_end`). What it reads and
writes is the optimizer's state in three values
(:mod:`mixprec_torch.step.optimizer_state`): the :class:`Layout` of its parameter groups
(:func:`layout`, built once per change of the groups), its :class:`Iteration` (replaced by a
fresh one when the step ends, taken or skipped) and its history (the tracker, the skip
records).

**What the user wrote since mixprec last did** (:mod:`mixprec_torch.step.model_edits`) is
taken where it is checked: a clip of the model's gradients after ``unscale_`` in the guard
pass (:func:`guard`), before the check that decides the skip; a gradient written between
the round and this optimizer's own step by a second guard pass of that optimizer
(:func:`_written_since_check`); weight surgery since the last master copy right before the
update (:func:`_update`).

**Rounds and skipping together.** All optimizers of one ``wrap`` call share one
:class:`~mixprec.LossScaler`. The first ``step()`` after scaled backward passes opens a
*round* (:func:`open_round`): it unscales every optimizer of the group that had a scaled
backward since its last step (``scale_loss(loss, [opt_d, opt_g])`` puts both in), ORs their
overflow flags, all-reduces the flag across ranks, reads it once on the host, updates the
scaler once and records the decision. Each optimizer of the round then applies that decision
when its own ``step()`` runs, so the optimizers of one backward pass skip together, and the
scale is updated exactly once per round (``torch.amp.GradScaler``'s ``update()`` per
iteration). A GAN loop that steps the discriminator and then the generator after separate
backward passes has two rounds per iteration, each with its own decision. With
``DynamicScale(skip="optimizer")`` (``WrapGroup.skip_each``) a round still updates the scale
once, from all its flags, but each optimizer skips only when its own gradients overflowed,
as ``torch.amp.GradScaler`` does.

**Closures.** ``optimizer.step(closure)`` (``torch.optim.LBFGS``, Lightning- and
Accelerate-style loops) runs under policies that scale no loss: the closure is evaluated
once before the step (its plain ``loss.backward()`` is the step's backward pass, so the step
is guarded and may skip), and the optimizer's own calls get that result first; every
further call (LBFGS's line search) copies the masters into the model, re-runs the closure
and casts its gradients into the masters. Under loss scaling the closure's backward would
not be scaled, so ``step(closure)`` is refused before anything runs.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from mixprec.errors import StepOrderError
from mixprec.kit import Stage

from ..cpu import clib
from ..cpu.grad_check import GuardPlan, native_unscale
from ..torch_private import (
    foreach_copy_,
    foreach_norm_float32,
    mark_step_hooked,
    non_finite_check_and_unscale_,
    run_step_hooks,
    sparse_values,
    tensor_versions,
)
from .checkpoint import is_dcp_init_step
from .diagnostics import record_overflows
from .distributed import all_reduce_found_inf, check_first_step, consensus_group, is_distributed
from .master_update import foreach_groups, foreach_sgd_elements
from .model_edits import (
    cast_grads_into,
    grad_buffers,
    held_grads,
    keep_dropped_grads,
    mark_copied,
    refresh_edited_masters,
    take_grad_edits,
)
from .optimizer_state import (
    Iteration,
    Layout,
    OptimizerState,
    Round,
    WrapGroup,
    base_class,
    optimizer_state,
)

__all__ = [
    "check_grads",
    "copies",
    "copy_grads_to_masters",
    "copy_masters_to_model",
    "count_plain_backward",
    "guard",
    "layout",
    "open_round",
    "reduce_found_inf",
    "scaled_loss",
    "step",
    "unscale",
]


# ------------------------------------------------------------------ 1. scale the loss


def scaled_loss(loss: torch.Tensor, group: WrapGroup) -> torch.Tensor:
    """``loss`` in float32, multiplied by the group's loss scale when scaling is on."""
    scaled = loss if loss.dtype == torch.float32 else loss.to(torch.float32)
    scaler = group.scaler
    return scaled * scaler.scale if scaler.enabled else scaled


# ------------------------------------------------------------------ 3. unscale


def layout(st: OptimizerState, optimizer: torch.optim.Optimizer) -> Layout:
    """The optimizer's :class:`Layout`: built from the group's master map on first use, kept
    until the param groups change (``add_param_group`` drops it)."""
    lay = st.layout
    if lay is None:
        by_master = {id(m): p for p, m in st.group.masters.copied_pairs()}
        params: list[torch.Tensor] = []
        masters: list[torch.Tensor] = []
        for pg in optimizer.param_groups:
            for master in pg["params"]:
                param = by_master.pop(id(master), None)  # pop: tied weights share one master
                if param is not None:
                    params.append(param)
                    masters.append(master)
        lay = st.layout = Layout(params, masters)
    return lay


def copies(st: OptimizerState, optimizer: torch.optim.Optimizer) -> tuple[list[Any], list[Any]]:
    """(model params, their separate masters) among the optimizer's params: the layout's
    pair of lists."""
    return layout(st, optimizer).pairs


def copy_grads_to_masters(st: OptimizerState, optimizer: torch.optim.Optimizer) -> None:
    """Cast the model gradients into the masters' float32 gradients (None stays None)."""
    lay = layout(st, optimizer)
    cast_grads_into([param.grad for param in lay.params], lay.masters, st.spare_grads)
    st.iteration.grads_cast = True


def _fused(st: OptimizerState, optimizer: torch.optim.Optimizer, lay: Layout) -> bool:
    """Whether the compensated fused update takes the optimizer now: the walk over its
    parameters once per layout (:attr:`Layout.fusable`), its groups' options at each call
    (cheap, and they may change: a compiled step sets ``capturable`` while it traces)."""
    compensation = st.group.compensation
    if compensation is None:
        return False
    fusable = lay.fusable
    if fusable is None:
        fusable = lay.fusable = compensation.fusable_params(optimizer)
    return fusable and compensation.fusable_options(optimizer)


def unscale(
    st: OptimizerState,
    optimizer: torch.optim.Optimizer,
    scale: float | None = None,
    *,
    check: bool = True,
) -> None:
    """Unscale the gradients the optimizer will apply, in place, and record overflow.

    Per (device, dtype): one fused unscale-and-check (only when the loss is scaled), then,
    with ``check``, the guard's check (:func:`check_grads`). Without loss scaling the check
    alone reads the gradients, so the bf16 presets read them once. The flags stay on the
    device in the iteration's ``found_inf`` (no host sync here). ``scale`` divides instead of
    the group's scale (the apex shim's per-loss scalers).

    Where every gradient is a dense CPU tensor and the native kernels are built, the cast,
    the unscale and the check are one pass (:func:`~mixprec_torch.cpu.grad_check.native_unscale`),
    whose verdict is on the host already (``found_on_host``); under the fused compensated
    update the model's gradients are then only read.

    ``check=False`` (``unscale_``, the apex shim's ``scale_loss`` exit) leaves the guard's
    check to the step (:func:`guard`), so it sees the gradients after whatever the user
    did to them since (a clip, an edit), in the same one pass. It takes the torch path, which
    casts into the masters' gradients: they are there for the user to clip.
    """
    it = st.iteration
    scaler = st.group.scaler
    if check and st.local is None:
        lay = layout(st, optimizer)
        plan = lay.guard_plan
        if plan is None:
            plan = lay.guard_plan = GuardPlan(lay.pairs, optimizer, lay.model_of)
        # only a CPU plan asks for the C library: a CUDA run never loads it
        lib = clib.library() if plan.usable else None
        if lib is not None:
            scaled_now = scale is not None or scaler.enabled
            inv = 1.0 / (scale if scale is not None else scaler.scale) if scaled_now else None
            cast = scaled_now or not _fused(st, optimizer, lay)
            spare = st.spare_grads
            found = native_unscale(
                lib, plan, inv, cast, lambda grads, masters: grad_buffers(grads, masters, spare)
            )
            if found is not None:
                it.grads_cast = cast
                it.found_inf = []
                it.found_on_host = found
                it.unchecked = False
                it.dense_grads = True  # the pass takes strided gradients only
                return
    copy_grads_to_masters(st, optimizer)
    by_device = _grads_by_device(st, optimizer)
    scaled = scale is not None or scaler.enabled
    if scale is None:
        scale = scaler.scale if scaler.enabled else 1.0
    found_list = []
    with torch.no_grad():
        for device, per_dtype in by_device.items():
            found_t = torch.zeros(1, dtype=torch.float32, device=device)
            if scaled:
                inv_scale = torch.full((), 1.0 / scale, dtype=torch.float32, device=device)
                for grads in per_dtype.values():
                    non_finite_check_and_unscale_(grads, found_t, inv_scale)
            if check:
                found_t.add_(_norm_overflow(per_dtype.values()))
            found_list.append(found_t)
    it.found_inf = found_list
    it.found_on_host = None
    it.unchecked = not check


def guard(st: OptimizerState, optimizer: torch.optim.Optimizer) -> bool:
    """The guard pass of one optimizer of a round: its gradients unscaled and checked when
    they are still scaled (:func:`unscale`), or, after ``unscale_``, the user's writes to the
    model's gradients since taken into the masters' (a clip,
    :func:`~mixprec_torch.step.model_edits.take_grad_edits`) and checked as they are now.
    Returns whether it unscaled them."""
    if st.tracker.needs_unscale:
        unscale(st, optimizer)
        return True
    if st.iteration.unchecked:  # unscale_() ran: check the gradients as the user left them
        lay = layout(st, optimizer)
        take_grad_edits(st, lay.params, lay.masters)
        check_grads(st, optimizer)
    return False


def check_grads(st: OptimizerState, optimizer: torch.optim.Optimizer) -> None:
    """The guard's check of the gradients the optimizer will apply, as they are now: one
    fused float32 norm per (device, dtype); a flag is set when a gradient is inf or NaN *or*
    the sum of the squared norms overflows float32 (:mod:`mixprec.guard`: a finite but huge
    gradient would put inf into Adam's state or blow up the weights). The flags join
    the iteration's ``found_inf`` (on the device, no host sync)."""
    with torch.no_grad():
        flags = [
            _norm_overflow(per_dtype.values())
            for per_dtype in _grads_by_device(st, optimizer).values()
        ]
    it = st.iteration
    it.found_inf = [*it.found_inf, *flags]
    it.unchecked = False


def _grads_by_device(
    st: OptimizerState, optimizer: torch.optim.Optimizer
) -> dict[torch.device, dict[torch.dtype, list[torch.Tensor]]]:
    """The gradients the optimizer applies (this rank's part), by device and dtype; whether
    none is sparse goes to the iteration (:attr:`Iteration.dense_grads`)."""
    by_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
        lambda: defaultdict(list)
    )
    dense = True
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if st.local is not None:
                grad = st.local(grad)
            if grad.is_sparse:
                dense = False
                if grad.dtype is torch.float16 and not grad.is_coalesced():
                    param.grad = grad = grad.coalesce()
                grad = sparse_values(grad)
            by_device[grad.device][grad.dtype].append(grad)
    st.iteration.dense_grads = dense
    return by_device


def _norm_overflow(grads_by_dtype: Any) -> torch.Tensor:
    """1.0 (a one-element float32 tensor on the device) when the summed squared norms of
    ``grads_by_dtype`` (lists of tensors on one device) are inf or NaN, else 0.0."""
    norms: list[torch.Tensor] = []
    for grads in grads_by_dtype:
        norms.extend(foreach_norm_float32(grads))
    squared = torch.stack(norms).square().sum()  # inf or NaN: overflow or non-finite
    return torch.isfinite(squared).logical_not().reshape(1).to(torch.float32)


def checked_grads(optimizer: torch.optim.Optimizer) -> tuple[list[torch.Tensor], list[int]]:
    """The gradients the optimizer applies and their version counters: what a later step
    compares to notice a write after the check (:func:`edited_since_check`)."""
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    return grads, tensor_versions(grads)


def edited_since_check(
    optimizer: torch.optim.Optimizer, kept: tuple[list[torch.Tensor], list[int]]
) -> bool:
    """Whether a gradient the optimizer applies was replaced or written since ``kept``."""
    grads, versions = checked_grads(optimizer)
    before, before_versions = kept
    return (
        versions != before_versions
        or any(a is not b for a, b in zip(grads, before, strict=False))
        or len(grads) != len(before)
    )


# ------------------------------------------------------------------ 4. found_inf across ranks


def reduce_found_inf(
    flags: list[torch.Tensor],
    device: str | torch.device,
    step: int | None = None,
    *,
    found: bool | None = None,
    group: WrapGroup | None = None,
) -> bool:
    """Whether any flag, on any rank, saw an inf or NaN: the step's one host sync. The ranks
    are those of ``group``'s consensus (:func:`~.distributed.consensus_group`).

    ``found`` is a verdict already on the host (the native guard pass's), None where there
    is none. In a single process a True verdict decides without a sync, and without device
    flags nothing is read.

    Every rank must make the same collective calls, or the ranks that call wait forever
    for the ones that do not. A rank whose optimizers hold no gradients this step (unused
    parameters, an empty shard, a model part that only other ranks run) has no flags, but
    still joins the all-reduce with a zero flag whenever ``torch.distributed`` runs several
    ranks.
    """
    pg = consensus_group(group)
    if not is_distributed(pg):
        if found or not flags:
            return bool(found)
    else:
        if found is not None:  # the native pass's verdict, as the CPU flag it stands for
            flags = [*flags, torch.full((1,), float(found), dtype=torch.float32)]
        if not flags:
            flags = [torch.zeros(1, dtype=torch.float32, device=device)]
    total = (
        flags[0] if len(flags) == 1 else torch.stack([f.to(flags[0].device) for f in flags]).sum(0)
    )
    return bool(all_reduce_found_inf(total, pg, step=step).item())


# ------------------------------------------------------------------ 5-8. the round and the step


def open_round(group: WrapGroup, optimizer: torch.optim.Optimizer) -> Round:
    """The guard pass of every optimizer of the group with a pending backward (3), found_inf
    reduced (4), overflows recorded on a skip (8), the scaler updated once (6); each member's
    iteration gets the decision."""
    live = group.live_states()
    members: list[tuple[OptimizerState, torch.optim.Optimizer]] = []
    for st in live:
        opt = st.optimizer()
        if opt is None or st.iteration.round is not None:
            continue
        tracker = st.tracker
        if tracker.stage is Stage.UNSCALED or tracker.needs_unscale:
            members.append((st, opt))
    flags: list[torch.Tensor] = []
    host: bool | None = None
    for st, opt in members:
        it = st.iteration
        if guard(st, opt) and opt is not optimizer:
            st.tracker.on_unscale()
            it.implicit_unscale = True
        if opt is not optimizer:  # it steps later: a write before its step() is checked then
            it.checked = checked_grads(opt)
        flags.extend(it.found_inf)
        if it.found_on_host is not None:
            host = bool(host) or it.found_on_host
    guards = group.round_guards
    scope = group.scope([st for st, _ in members], live) if guards else frozenset()
    guard_flags = [f for g in guards if (f := g.flag(scope)) is not None]
    step = group.scaler.steps
    if group.skip_each:  # one host sync per member for its own decision (GradScaler's)
        own = [
            reduce_found_inf(
                st.iteration.found_inf + guard_flags,
                group.device,
                step,
                found=st.iteration.found_on_host,
                group=group,
            )
            for st, _ in members
        ]
        found_inf = any(own)  # the scale still updates once, from any member's overflow
    else:  # a NaN batch may poison BatchNorm with finite grads: the guards' flags join
        found_inf = reduce_found_inf(
            flags + guard_flags, group.device, step, found=host, group=group
        )
        own = [found_inf] * len(members)
    for round_guard in guards:  # before the update: a floor that raises still restores
        round_guard.settle(found_inf, scope)
    overflowing: tuple[str, ...] = ()
    if found_inf:  # before the update, so skip hooks can already ask which params overflowed
        overflowed = [m for m, o in zip(members, own, strict=True) if o]
        overflowing = record_overflows(step, overflowed)
    ranked = found_inf and is_distributed(consensus_group(group))  # named by the skip warning
    rank = torch.distributed.get_rank() if ranked else None
    decision = Round(group.scaler.update(found_inf, overflowing, rank=rank))
    for (st, _), overflowed_here in zip(members, own, strict=True):
        it = st.iteration
        it.round = decision if overflowed_here == found_inf else Round(overflowed_here)
        it.found_inf = []
        it.found_on_host = None
    return decision


def count_plain_backward(st: OptimizerState) -> bool:
    """Count a plain ``loss.backward()`` as the backward pass of this step when the group
    scales no loss (the bf16 presets, O0): ``scale_loss`` only casts the loss to float32
    there, so loops that never call it (``accelerator.backward(loss)``, Lightning, other
    frameworks) step exactly as they would with it. Returns whether a backward pass is
    accounted for now.
    """
    tracker = st.tracker
    if tracker.stage is Stage.UNSCALED or tracker.needs_unscale or st.iteration.round is not None:
        return True
    if tracker.stage is Stage.READY and not st.group.scaler.enabled:
        tracker.on_backward()
        return True
    return False


def _missing_scale_loss(st: OptimizerState) -> StepOrderError:
    return StepOrderError(
        "optimizer.step() found no backward pass through scale_loss since the last step, and "
        f"policy {st.group.policy} scales the loss (scale {st.group.scaler.scale:g}): gradients "
        "from a plain loss.backward() (or accelerator.backward(loss)) were never multiplied by "
        "the scale. Call backward inside scale_loss: "
        "with mixprec.torch.scale_loss(loss, optimizer) as scaled: scaled.backward()"
    )


def step(self: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
    """The patched ``optimizer.step()``: evaluate the closure if one is given, join or open
    the round, then skip or step (5) and copy the masters into the model (7); the iteration
    ends either way (:func:`_end`)."""
    st = optimizer_state(self, "optimizer.step()")
    if closure is None and is_dcp_init_step(st, self):  # DCP's dummy step: never counted
        out = base_class(self).step(self)
        if st.group.lowbit is not None:  # a low-bit state: DCP's template holds codes too
            st.group.lowbit.narrow(self)
        return out
    if not st.models_checked:  # the models still hold the params wrap converted
        check_first_step(st, self)
    attrs = vars(self)
    if "found_inf" in attrs or "grad_scale" in attrs:
        raise _grad_scaler_driving(st, self)
    loss = None
    if closure is not None:
        _check_closure(st, self)
        with torch.enable_grad():
            loss = closure()
    tracker = st.tracker
    if not count_plain_backward(st):
        if tracker.stage is Stage.READY:
            raise _missing_scale_loss(st)
        tracker.on_step()  # raises the StepOrderError that names what is missing
    it = st.iteration
    if it.round is None:
        open_round(st.group, self)  # sets it.round: the caller is always one of the round
    # its own round, not the shared decision: under skip_each it is this optimizer's own
    decision = it.round
    tracker.on_step()
    try:
        if decision is None or not decision.skipped:
            _update(st, self, closure, loss)
    finally:
        _end(st, self)
    return loss


def _update(
    st: OptimizerState,
    optimizer: torch.optim.Optimizer,
    closure: Callable[[], Any] | None,
    loss: Any,
) -> None:
    """The update of a step the round did not skip: unless a gradient was written since
    another optimizer's round checked it and overflows now (this optimizer's own skip; the
    scale is already updated), the user's weight edits are carried into the masters, the
    optimizer's own update runs on them (or the compensated strategy's) and the masters are
    copied into the model."""
    if st.iteration.checked is not None and _written_since_check(st, optimizer):
        st.own_skips += 1  # the round was not skipped: state(optimizer) says this one was
        st.own_skip_at = st.group.scaler.steps
        return
    lay = layout(st, optimizer)
    compensation = st.group.compensation
    lowbit = st.group.lowbit
    if compensation is None:
        if lay.params:  # weights written since the last master copy (weight surgery)
            refresh_edited_masters(st.group, lay)
        if lowbit is not None and closure is None and lowbit.step_fused(optimizer):
            # one pass per tensor: decode, update, encode (torch's SGD/Adam/AdamW, CPU)
            if lay.params:
                copy_masters_to_model(st, optimizer, lay)
            return
    elif lowbit is None and _fused(st, optimizer, lay):
        # one pass per tensor, no float32 working masters (torch's SGD/Adam/AdamW)
        grads_cast = st.iteration.grads_cast
        run_step_hooks(
            optimizer, lambda: compensation.step_fused(optimizer, master_grads=grads_cast)
        )
        return
    else:
        if not st.iteration.grads_cast:  # the guard pass left them to the fused update
            copy_grads_to_masters(st, optimizer)
        compensation.fill(optimizer)  # float32 working masters: w + c (kahan) or w
    if lowbit is not None:
        lowbit.widen(optimizer)  # the quantized state decoded into float32
    if closure is None:
        elements = lay.foreach_sgd
        if elements is None:
            elements = lay.foreach_sgd = foreach_sgd_elements(optimizer)
        if elements and st.iteration.dense_grads:  # torch's foreach SGD: the same bits
            foreach_groups(optimizer, elements, lambda: base_class(optimizer).step(optimizer))
        else:
            base_class(optimizer).step(optimizer)
    else:
        base_class(optimizer).step(optimizer, _reevaluating(st, optimizer, closure, loss))  # type: ignore[call-arg]
    if lowbit is not None:
        lowbit.narrow(optimizer)  # and encoded again
    if compensation is not None:
        compensation.store(optimizer)  # back into bfloat16 params, the residual or noise kept
    elif lay.params:
        copy_masters_to_model(st, optimizer, lay)


def _end(st: OptimizerState, optimizer: torch.optim.Optimizer) -> None:
    """The end of the iteration, taken or skipped: the tracker moves on, a fresh
    :class:`Iteration` replaces this one, and under the apex shim the masters' gradients
    are dropped."""
    st.tracker.on_update()
    st.iteration = Iteration()
    if st.drop_master_grads:
        _drop_master_grads(st, optimizer)


def _drop_master_grads(st: OptimizerState, optimizer: torch.optim.Optimizer) -> None:
    """Set the separate masters' gradients to None, keeping their memory for the next cast
    (:func:`~mixprec_torch.step.model_edits.keep_dropped_grads`)."""
    masters = layout(st, optimizer).masters
    held = held_grads(masters)
    for master in masters:
        master.grad = None
    keep_dropped_grads(st.spare_grads, held)


def _written_since_check(st: OptimizerState, optimizer: torch.optim.Optimizer) -> bool:
    """Whether this optimizer, checked when another optimizer's ``step()`` opened the round,
    has gradients written since that are now inf/NaN or overflow (a clip or an edit between
    the two steps, of the masters' gradients or, after ``unscale_``, of the model's): a second
    guard pass over them. Checked on this rank alone: an all-reduce here would hang ranks
    that made no such write, and DDP's gradients are the same on every rank anyway."""
    it = st.iteration
    kept, it.checked = it.checked, None
    # after an unscale_() since the round: the model's gradients' edits go into the masters'
    lay = layout(st, optimizer)
    take_grad_edits(st, lay.params, lay.masters)
    if kept is None or not edited_since_check(optimizer, kept):
        return False
    it.found_inf = []
    check_grads(st, optimizer)
    return any(bool(flag.item()) for flag in it.found_inf)


def _grad_scaler_driving(st: OptimizerState, optimizer: torch.optim.Optimizer) -> StepOrderError:
    """The error for a ``torch.amp.GradScaler`` calling this step (a migration that kept
    ``scaler.step(optimizer)``): it multiplied the loss by its own scale, which mixprec
    cannot see, so the update would be that many times too large. The attributes the
    GradScaler set are removed; nothing else has changed."""
    scale = getattr(optimizer, "grad_scale", None)
    for name in ("grad_scale", "found_inf"):
        vars(optimizer).pop(name, None)
    shown = f" ({float(scale):g})" if isinstance(scale, torch.Tensor) else ""
    return StepOrderError(
        "a torch.amp.GradScaler is stepping this optimizer (scaler.step(optimizer)), which "
        f"mixprec.torch.wrap already manages under policy {st.group.policy}: the GradScaler "
        f"multiplied the loss by its own scale{shown}, and the update would be that many "
        "times too large. Remove the GradScaler (nothing was changed): replace "
        "scaler.scale(loss).backward() with 'with mixprec.torch.scale_loss(loss, optimizer) "
        "as scaled: scaled.backward()', scaler.unscale_(optimizer) with "
        "mixprec.torch.unscale_(optimizer), scaler.step(optimizer) with optimizer.step(), "
        "and drop scaler.update()"
    )


def _check_closure(st: OptimizerState, optimizer: torch.optim.Optimizer) -> None:
    """Refuse ``step(closure)`` where it cannot work, before anything runs."""
    fix = (
        "run the closure's work yourself: optimizer.zero_grad(); loss = compute_loss(); "
        "with mixprec.torch.scale_loss(loss, optimizer) as scaled: scaled.backward(); "
        "then call optimizer.step() without a closure"
    )
    if st.group.scaler.enabled:
        raise StepOrderError(
            f"optimizer.step(closure) under policy {st.group.policy}, which scales the loss "
            f"(scale {st.group.scaler.scale:g}), is not supported, and the closure was not "
            "run: each evaluation's gradients would need unscaling and an overflow check, and "
            "an optimizer that re-evaluates the closure (LBFGS's line search) cannot skip a "
            "step half-way through. Use a policy without loss scaling (a bf16 preset, or "
            "loss_scale=None), or " + fix
        )
    if st.group.compensation is not None:
        raise StepOrderError(
            f"optimizer.step(closure) under policy {st.group.policy}: its compensated "
            "masters (master=kahan|stochastic) exist only inside one optimizer update, and a "
            "closure that re-runs the model (LBFGS) would read stale weights; " + fix
        )
    if st.tracker.stage is not Stage.READY or st.iteration.round is not None:
        raise StepOrderError(
            "optimizer.step(closure) after unscale_ or with a step of the same round "
            "pending: the closure computes this step's gradients itself. Either call "
            "optimizer.step() without a closure, or let the closure do the backward pass"
        )
    base_step = base_class(optimizer).step
    if "closure" not in inspect.signature(base_step).parameters:
        raise StepOrderError(
            f"optimizer.step(closure): {type(optimizer).__name__}.step takes no closure; "
            "call the closure yourself, then optimizer.step() without one"
        )


def _reevaluating(
    st: OptimizerState,
    optimizer: torch.optim.Optimizer,
    closure: Callable[[], Any],
    first: Any,
) -> Callable[[], Any]:
    """The closure the optimizer's own step gets: the loss already computed on its first
    call; on every further call (LBFGS's line search) the masters are copied into the model,
    the closure runs again and its gradients are cast into the masters."""
    calls = 0
    it = st.iteration

    def evaluate() -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return first
        copy_masters_to_model(st, optimizer)
        it.reevaluating = True
        try:
            with torch.enable_grad():
                loss = closure()
        finally:
            it.reevaluating = False
        copy_grads_to_masters(st, optimizer)
        return loss

    return evaluate


mark_step_hooked(step)  # torch's profiling wrapper is already inside the base class's step


def copy_masters_to_model(
    st: OptimizerState, optimizer: torch.optim.Optimizer, lay: Layout | None = None
) -> None:
    """Copy every separate master into its model parameter (one fused foreach copy)."""
    lay = layout(st, optimizer) if lay is None else lay
    if lay.params:
        with torch.no_grad():
            foreach_copy_(lay.params, lay.masters)
        mark_copied(lay)
