"""``wrap``: convert models and optimizers in place under one resolved policy.

``wrap`` is plan, then apply. The plan (:mod:`mixprec_torch.wrapping.planning`) checks everything
that can be refused and decides every dtype, hook and master without changing anything, so
a ``wrap`` that raises leaves the models, the optimizers and their state exactly as they
were. Then :func:`apply_plan` converts: float32 masters are copied from the still-float32
parameters (for every parameter the plan casts, frozen ones included, so that
``state_dict()`` saves exact values; the optimizer updates the masters of its own
parameters; a ``wrap`` without optimizers, for inference, keeps no float32 copy at all),
parameters and buffers are cast, the forward and state-dict hooks are installed, and each
optimizer gets the patched class and the masters (:mod:`mixprec_torch.step.optimizer`). One
:class:`~mixprec.LossScaler` serves every optimizer of the call, so they skip together.

Convert the model to its device (and dtype) before ``wrap``: ``model.to(...)`` afterwards
would move the parameters away from their masters and the plan.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from mixprec.kit import (
    FLOAT32,
    LossScaler,
    MasterWeights,
    Policy,
    StepGuard,
    check_seed,
    parse_state_format,
    resolve_for_device,
)

from ..compensated.compensation import Compensation
from ..devices import capabilities, device_capability, device_key
from ..dtypes import dtype_name, torch_dtype
from ..lowbit.state import LowBitState
from ..step.checkpoint import ModelCheckpoint
from ..step.distributed import check_process_group, register_consensus
from ..step.master_update import prefer_fused_kernel
from ..step.model_edits import record_param_versions
from ..step.optimizer import patch_optimizer
from ..step.optimizer_state import WrapGroup
from .casting import ModelCasting
from .planning import ModelRecord, WrapPlan, check_arguments, first_device, plan_wrap
from .running_stats import RunningStats
from .sharding import local_tensor

__all__ = ["ModelRecord", "apply_plan", "resolve_policy", "wrap"]

logger = logging.getLogger("mixprec.torch")


def resolve_policy(
    models: list[nn.Module], policy: Any, **overrides: Any
) -> tuple[torch.device, Policy]:
    """The device of ``models``' first parameter and ``policy`` resolved for it (``"auto"``
    and the device's capabilities), as ``wrap`` resolves it."""
    device = first_device(models)
    caps = capabilities() if device_capability(device) is not None else None
    return device, resolve_for_device(policy, "torch", device_key(device), caps, **overrides)


def _listify(value: Any) -> tuple[list[Any], bool]:
    if value is None:
        return [], False
    if isinstance(value, (list, tuple)):
        return list(value), True
    return [value], False


def wrap(
    models: Any,
    optimizers: Any = None,
    policy: Any = "auto",
    *,
    guard: StepGuard | Mapping[str, Any] | None = None,
    seed: int = 0,
    keep_dtypes: bool = False,
    process_group: Any = None,
    **overrides: Any,
) -> Any:
    """Convert ``models`` (in place) and ``optimizers`` for mixed precision under ``policy``.

    :param models: an ``nn.Module`` or a list of them.
    :param optimizers: a ``torch.optim.Optimizer``, a list of them, or None (inference).
    :param policy: a preset (``"O1"``, ``"O2-bf16"``, ``"torch-autocast"``...), a key-grammar
        string, a TOML path, a dict or a :class:`mixprec.Policy`; ``"auto"`` (the default)
        picks O1 with the fastest low-precision dtype of the model's device.
    :param guard: a :class:`mixprec.StepGuard` (or a dict of its options): how often
        repeated skipped steps warn (``warn_after``, default 10 in a row). Every step whose
        gradients are non-finite or whose squared norm overflows float32 is skipped, under
        every policy, and a skipped step restores BatchNorm running statistics.
    :param seed: seeds the stochastic rounding of ``master=stochastic`` (``O3-bf16-sr``)
        and of ``state=bfloat16``'s optimizer state; the generator's state is saved with
        ``optimizer.state_dict()``.
    :param keep_dtypes: every parameter and buffer keeps its own dtype (a model with some
        bfloat16 and some float32 parameters stays so): ``policy.param`` and module pins
        cast nothing and inputs are not cast at the boundary; op casting (O1) still runs,
        and the low-precision parameters get masters where the policy keeps masters (apex's
        ``cast_model_type=False``).
    :param process_group: where the per-step overflow flag is all-reduced, so that ranks skip
        together: the ``torch.distributed.ProcessGroup`` the model's gradients are reduced
        over; ``"local"`` for a model only this rank trains (a probe, a teacher, an
        evaluator: its steps make no collective call); None (default) finds it: the group of
        the DDP running the model's forward, else the 1-D FSDP2 mesh of its parameters, else
        the default group.
    :param overrides: policy fields (``compute="float16"``, ``loss_scale="dynamic"``...).
    :returns: what was given, in the same shape: ``model``, ``(model, optimizer)``,
        ``([models], [optimizers])``...
    :raises WrapError: a model or optimizer that cannot be wrapped, or a ``seed`` that is
        not a non-negative int (the message says why and how to fix it); nothing is
        changed then.
    :raises UnsupportedDtypeError: a parameter on a device that cannot compute the policy.
    :raises PolicyError: a bad policy spec.

    Example::

        import torch
        import mixprec.torch as mpt

        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 2))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = mpt.wrap(model, optimizer, policy="O2-bf16")
        x, y = torch.randn(4, 8), torch.tensor([0, 1, 1, 0])
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        with mpt.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        print(mpt.state(optimizer).skipped_steps)   # 0
    """
    step_guard = StepGuard.coerce(guard)
    seed = check_seed(seed)
    process_group = check_process_group(process_group)
    model_list, models_listed = _listify(models)
    opt_list, opts_listed = _listify(optimizers)
    params = check_arguments(model_list, opt_list)

    device, resolved = resolve_policy(model_list, policy, **overrides)

    plan = plan_wrap(model_list, opt_list, params, resolved, device, keep_dtypes=keep_dtypes)
    # ---- nothing was changed above this line; from here on the conversion happens
    group = apply_plan(plan, step_guard, seed=seed, process_group=process_group)

    logger.info("mixprec.torch.wrap: policy %s on %s", resolved, group.device)

    out_models = model_list if models_listed else model_list[0]
    if optimizers is None:
        return out_models
    out_opts = opt_list if opts_listed else opt_list[0]
    return out_models, out_opts


def apply_plan(
    plan: WrapPlan, guard: StepGuard | None = None, *, seed: int = 0, process_group: Any = None
) -> WrapGroup:
    """Convert the models and optimizers as ``plan`` decided; return the wrap call's group.
    ``process_group``: where its overflow flag is reduced (see :func:`wrap`).

    Nothing here refuses: every check ran in :func:`~mixprec_torch.wrapping.planning.plan_wrap`.
    """
    policy, planned = plan.policy, plan.planned
    strategy = policy.master_strategy
    master_dtype = FLOAT32 if strategy is not None else policy.master
    masters: MasterWeights[torch.Tensor] = MasterWeights(
        [param for _, param in plan.params.values()],
        master_dtype=master_dtype if plan.masters_on else None,
        dtype_of=lambda p: (
            planned.get(id(p), dtype_name(p.dtype)) if p.is_floating_point() else "float32"
        ),
        make_master=_master_maker(master_dtype or FLOAT32),
    )
    names = {pid: name for pid, (name, _) in plan.params.items()}
    scaler = LossScaler(policy.loss_scale, guard=guard)
    group = WrapGroup(policy, scaler, device_key(plan.device), masters, names)
    group.model_count = len(plan.models)
    for index, model in reversed(list(enumerate(plan.models))):  # a shared param: its first
        group.param_models.update((id(p), index) for p in model.parameters())
    if plan.optimizers:  # a skipped step puts the running statistics back
        stats = RunningStats(plan.models)
        if len(stats):
            group.round_guards.append(stats)
    # inference (no optimizer) keeps no float32 copy of anything: no masters (see
    # WrapPlan.masters_on), no buffer originals; state_dict() then upcasts
    originals = [_buffer_originals(c) if plan.optimizers else {} for c in plan.castings]
    for casting in plan.castings:
        casting.apply_param_dtypes()
    if strategy is not None and plan.masters_on:
        # after the cast: the masters still hold the exact float32 values, the params bf16
        pairs = [(p, m) for p, m in masters.copied_pairs() if p.dtype == torch.bfloat16]
        group.compensation = Compensation(pairs, strategy, seed, state=policy.state)
    lowbit = parse_state_format(policy.state) if policy.state is not None else None
    if lowbit is not None and plan.optimizers:
        updated = {id(m): names[id(p)] for p, m in masters.copied_pairs() if id(p) in names}
        updated.update((pid, name) for pid, name in names.items() if pid not in updated)
        group.lowbit = LowBitState(lowbit, updated)
    if plan.fp8 is not None:  # before the casting hooks, which may wrap the forwards
        plan.fp8.install()
        group.fp8 = plan.fp8
        if plan.optimizers:  # the delayed histories move with the steps
            group.round_guards.append(plan.fp8)
    for model, casting, buffers in zip(plan.models, plan.castings, originals, strict=True):
        casting.install(model)
        checkpoint = ModelCheckpoint(model, masters, buffers, group.compensation)
        setattr(model, "_mixprec", ModelRecord(group, casting, checkpoint))  # noqa: B010
    local = local_tensor if plan.fsdp else None
    for opt in plan.optimizers:
        patch_optimizer(opt, group, local=local)
        if group.compensation is None and masters.copied_pairs():
            prefer_fused_kernel(opt)  # float32 masters that mixprec made: one sweep, not ten
    # after the casts: later in-place writes to these are the user's (model_edits)
    record_param_versions(group, [param for param, _ in masters.copied_pairs()])
    if plan.optimizers:  # the first step checks the models and finds the consensus group
        register_consensus(group, plan.models, process_group)
    return group


def _master_maker(dtype: str) -> Any:
    master_dtype = torch_dtype(dtype)

    def make(param: nn.Parameter) -> torch.Tensor:
        # copied from the parameter before it is cast: the exact float32 value
        return nn.Parameter(
            param.detach().to(master_dtype, copy=True), requires_grad=param.requires_grad
        )

    return make


def _buffer_originals(casting: ModelCasting) -> dict[tuple[str, str], torch.Tensor]:
    """The float32 values of the buffers the plan will cast (for exact checkpoints)."""
    if not casting.cast_params:
        return {}
    out = {}
    for site in casting.sites:
        if site.dtype == FLOAT32:
            continue
        for bname, buf in site.module.named_buffers(recurse=False, remove_duplicate=False):
            if buf.dtype == torch.float32:
                out[(site.name, bname)] = buf.detach().clone()
    return out
