"""Patching an optimizer for mixprec: its class, its parameters, its state.

``wrap`` swaps each optimizer's class for a subclass of its own class (made once per class,
same name and module), so ``isinstance``, LR schedulers and ``zero_grad(set_to_none=...)``
keep working. The subclass overrides ``step`` (:func:`mixprec_torch.step.protocol.step`, the step
protocol), ``zero_grad`` and ``add_param_group`` (here), ``state_dict`` and
``load_state_dict`` (:mod:`mixprec_torch.step.checkpoint`), and refuses ``copy.deepcopy`` and
pickling (:mod:`mixprec_torch.copies`); the optimizer's ``param_groups`` hold
the float32 masters (apex O2 style), or the model parameters themselves where no copy is
needed. All optimizers of one ``wrap`` call share one :class:`~mixprec.LossScaler` and skip
together (see :mod:`mixprec_torch.step.protocol` for rounds). Optimizers that must *not* share a
scale (independent models trained in one loop) are wrapped in separate ``wrap`` calls, and
``scale_loss`` refuses to mix optimizers from different calls.

**LR schedulers.** ``optimizer.step()`` is called every iteration whether or not it skips,
so the scheduler counts iterations: a skipped step still advances the schedule (apex's
behaviour), and no "lr_scheduler.step() before optimizer.step()" warning appears even when
the very first step is skipped. To hold the schedule on skipped steps instead, check
``mixprec.torch.state(optimizer).last_step_skipped`` before ``scheduler.step()``.
"""

from __future__ import annotations

import inspect
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from mixprec.errors import WrapError

from ..copies import refuse_optimizer_copy
from ..torch_private import foreach_zero_, is_scheduler_step_wrapper, scheduler_step_wrapper
from .checkpoint import load_optimizer_state_dict, optimizer_state_dict
from .model_edits import held_grads, keep_dropped_grads
from .optimizer_state import OptimizerState, Round, WrapGroup, base_class, optimizer_state
from .protocol import layout, step

__all__ = [
    "OptimizerState",
    "Round",
    "WrapGroup",
    "add_param_group",
    "check_patchable",
    "optimizer_state",
    "patch_optimizer",
    "zero_grad",
]

_SUBCLASSES: dict[type, type] = {}


def zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
    """Zero the masters' gradients (the optimizer's params) and the model's gradients.

    With ``set_to_none=True`` every ``.grad`` becomes None, as in PyTorch, but under
    ``master=float32`` the masters' float32 gradient memory is kept for the next step's cast
    (:func:`~mixprec_torch.step.model_edits.keep_dropped_grads`): allocating 4 bytes per
    parameter again every step costs page faults on the CPU. Compensated strategies keep
    nothing between steps, so nothing is kept for them.
    """
    st: OptimizerState | None = getattr(self, "_mixprec", None)
    lay = None if st is None else layout(st, self)
    held = []
    if st is not None and lay is not None and st.group.compensation is None:
        held = held_grads(lay.masters)
    base = base_class(self)
    if _takes_set_to_none(base):
        base.zero_grad(self, set_to_none)
    else:  # a wrapper such as apex's LARC: zero_grad(self) clears its inner optimizer's
        base.zero_grad(self)
    if st is None or lay is None:
        return
    if held:
        keep_dropped_grads(st.spare_grads, held)
        del held  # the spare memory is reusable only once these tensors are gone
    model_grads = []
    for param in lay.params:
        if param.grad is None:
            continue
        if set_to_none:
            param.grad = None
        else:
            if param.grad.grad_fn is not None:
                param.grad.detach_()
            else:
                param.grad.requires_grad_(False)
            model_grads.append(param.grad)
    if model_grads:
        foreach_zero_(model_grads)


_TAKES_SET_TO_NONE: dict[type, bool] = {}


def _takes_set_to_none(cls: type) -> bool:
    """Whether ``cls.zero_grad`` accepts ``set_to_none`` (optimizer wrappers may not)."""
    known = _TAKES_SET_TO_NONE.get(cls)
    if known is None:
        params = inspect.signature(getattr(cls, "zero_grad")).parameters  # noqa: B009
        known = _TAKES_SET_TO_NONE[cls] = "set_to_none" in params or any(
            p.kind is p.VAR_KEYWORD for p in params.values()
        )
    return known


def add_param_group(self: torch.optim.Optimizer, param_group: dict[str, Any]) -> None:
    """Add a group of *model* parameters; the optimizer receives their masters."""
    st = getattr(self, "_mixprec", None)
    if st is None:  # during __init__ of a re-created instance
        base_class(self).add_param_group(self, param_group)
        return
    group = st.group
    params = param_group["params"]
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    unknown = [p for p in params if id(p) not in group.names]
    if unknown:
        raise WrapError(
            f"add_param_group got {len(unknown)} parameter(s) that are not in the models "
            f"wrapped with this optimizer (shapes {[tuple(p.shape) for p in unknown][:4]}); "
            "pass every model whose parameters the optimizer updates to the same wrap call"
        )
    masters = [group.masters.master_for(p) for p in params]
    base_class(self).add_param_group(self, {**param_group, "params": masters})
    st.layout = None  # rebuilt from the new groups on first use
    st.models |= _models_of(group, [{"params": params}])


def _models_of(group: WrapGroup, param_groups: list[dict[str, Any]]) -> frozenset[int]:
    """The indices of the group's models whose parameters are among ``param_groups``."""
    found = (group.param_models.get(id(p)) for pg in param_groups for p in pg["params"])
    return frozenset(i for i in found if i is not None)


def _subclass_for(cls: type) -> type:
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        namespace = {
            "step": step,
            "zero_grad": zero_grad,
            "add_param_group": add_param_group,
            "state_dict": optimizer_state_dict,
            "load_state_dict": load_optimizer_state_dict,
            # a copy would step copies of the masters no model reads: refused, naming
            # optimizer.state_dict() (mixprec_torch.copies)
            "__deepcopy__": refuse_optimizer_copy,
            "__reduce_ex__": refuse_optimizer_copy,
            # a torch.amp.GradScaler then hands its scale to step() (grad_scale, found_inf)
            # instead of unscaling the masters it does not know: step() refuses it by name
            "_step_supports_amp_scaling": True,
            "_mixprec_base": cls,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
        }
        sub = _SUBCLASSES[cls] = type(cls.__name__, (cls,), namespace)
    return sub


def check_patchable(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's instance ``step`` is an LR scheduler's wrapper (True), absent
    (False); WrapError when something else replaced it."""
    instance_step = vars(optimizer).get("step")
    if instance_step is None:
        return False
    if is_scheduler_step_wrapper(instance_step):
        return True
    raise WrapError(
        f"{type(optimizer).__name__}.step was replaced on this instance by {instance_step!r}; "
        "mixprec patches the optimizer's step itself. Wrap the optimizer before patching its "
        "step"
    )


def patch_optimizer(
    optimizer: torch.optim.Optimizer,
    group: WrapGroup,
    *,
    local: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> OptimizerState:
    """Point the optimizer at the masters and give it the patched class (in place).

    :param local: maps a gradient to the part this rank holds (FSDP2), or None.
    """
    rewrap = check_patchable(optimizer)
    st = OptimizerState(optimizer, group, local=local)
    st.models = _models_of(group, optimizer.param_groups)
    masters = group.masters
    for pg in optimizer.param_groups:
        swapped = [masters.master_for(p) for p in pg["params"]]
        if isinstance(pg["params"], list):
            # in place: optimizers that keep the list itself (LBFGS's ``_params``) see the
            # masters too
            pg["params"][:] = swapped
        else:
            pg["params"] = swapped
    if optimizer.state:
        # state built before wrap (a step taken or a state dict loaded): move it to the masters
        moved: defaultdict[torch.Tensor, Any] = defaultdict(dict)
        for param, value in optimizer.state.items():
            try:
                master = masters.master_for(param)
            except WrapError:  # state of a tensor the optimizer no longer holds: keep as is
                master = param
            if master is not param and isinstance(value, dict):
                value = {
                    k: v.to(master.dtype)
                    if isinstance(v, torch.Tensor)
                    and v.is_floating_point()
                    and v.shape == master.shape
                    else v
                    for k, v in value.items()
                }
            moved[master] = value
        state = optimizer.state
        state.clear()  # in place: a wrapper's state may be a property over its inner optimizer's
        state.update(moved)
    optimizer._mixprec = st  # type: ignore[attr-defined]
    optimizer.__class__ = _subclass_for(type(optimizer))
    if rewrap:
        # A scheduler built before wrap wrapped the *original* step on the instance; it
        # would bypass the patched class method, so wrap the patched one the same way.
        del optimizer.step
        optimizer.step = scheduler_step_wrapper(  # type: ignore[method-assign]
            optimizer, type(optimizer).step
        )
    group.states.append(weakref.ref(st))
    return st
