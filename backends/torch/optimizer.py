"""Patching an optimizer for mixprec: its class, its parameters, its state (and the step's story).

``wrap`` swaps each optimizer's class for a subclass of its own class (made once per class,
same name and module), so ``isinstance``, LR schedulers and ``zero_grad(set_to_none=...)``
keep working. The subclass overrides ``step``, ``zero_grad`` and ``add_param_group``
(:mod:`mixprec_torch.step`), ``state_dict`` and ``load_state_dict``
(:mod:`mixprec_torch.checkpoint`); the optimizer's ``param_groups`` hold the float32
masters (apex O2 style), or the model parameters themselves where no copy is needed.

**Rounds and skipping together.** All optimizers of one ``wrap`` call share one
:class:`~mixprec.LossScaler` (:class:`WrapGroup`). The first ``step()`` after scaled backward
passes opens a *round*: it unscales every optimizer of the group that had a scaled backward
since its last step (``scale_loss(loss, [opt_d, opt_g])`` puts both in), ORs their overflow
flags, all-reduces the flag across ranks, reads it once on the host, updates the scaler once
and records the decision. Each optimizer of the round then applies that decision when its
own ``step()`` runs, so the optimizers of one backward pass skip together, and the scale is
updated exactly once per round (``torch.amp.GradScaler``'s ``update()`` per iteration). A GAN
loop that steps the discriminator and then the generator after separate backward passes has
two rounds per iteration, each with its own decision. Optimizers that must *not* share a
scale (independent models trained in one loop) are wrapped in separate ``wrap`` calls, and
``scale_loss`` refuses to mix optimizers from different calls.

**LR schedulers.** ``optimizer.step()`` is called every iteration whether or not it skips,
so the scheduler counts iterations: a skipped step still advances the schedule (apex's
behaviour), and no "lr_scheduler.step() before optimizer.step()" warning appears even when
the very first step is skipped. To hold the schedule on skipped steps instead, check
``mixprec.torch.state(optimizer).last_step_skipped`` before ``scheduler.step()``.
"""

from __future__ import annotations

import functools
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from mixprec.errors import WrapError
from mixprec.scaler import MixprecState

from . import step as _step
from .checkpoint import load_optimizer_state_dict, optimizer_state_dict

# Re-exported: ``mixprec_torch.optimizer`` held these before the split, and code imports them.
from .loop import master_params, scale_loss, state, unscale_
from .optimizer_state import OptimizerState, Round, WrapGroup, optimizer_state

__all__ = [
    "MixprecState",
    "OptimizerState",
    "Round",
    "WrapGroup",
    "check_patchable",
    "master_params",
    "optimizer_state",
    "patch_optimizer",
    "scale_loss",
    "state",
    "unscale_",
]

_SUBCLASSES: dict[type, type] = {}


def _subclass_for(cls: type) -> type:
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        namespace = {
            "step": _step.step,
            "zero_grad": _step.zero_grad,
            "add_param_group": _step.add_param_group,
            "state_dict": optimizer_state_dict,
            "load_state_dict": load_optimizer_state_dict,
            "_mixprec_base": cls,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
        }
        sub = _SUBCLASSES[cls] = type(cls.__name__, (cls,), namespace)
    return sub


def _rewrap_scheduler_step(optimizer: torch.optim.Optimizer) -> None:
    """Re-create an LR scheduler's step-counting wrapper around the patched step.

    A scheduler built before ``wrap`` stored a wrapper around the *original* step as an
    instance attribute; it would bypass the patched class method.
    """
    del optimizer.step
    opt_ref = weakref.ref(optimizer)
    func = type(optimizer).step

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = opt_ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return func.__get__(opt, opt.__class__)(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


def check_patchable(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's instance ``step`` is an LR scheduler's wrapper (True), absent
    (False); WrapError when something else replaced it."""
    step = vars(optimizer).get("step")
    if step is None:
        return False
    if getattr(step, "_wrapped_by_lr_sched", False):
        return True
    raise WrapError(
        f"{type(optimizer).__name__}.step was replaced on this instance by {step!r}; mixprec "
        "patches the optimizer's step itself. Wrap the optimizer before patching its step"
    )


def patch_optimizer(
    optimizer: torch.optim.Optimizer,
    group: WrapGroup,
    *,
    local: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> OptimizerState:
    """Point the optimizer at the masters and give it the patched class (in place)."""
    rewrap = check_patchable(optimizer)
    st = OptimizerState(optimizer, group, local=local)
    for pg in optimizer.param_groups:
        pg["params"] = st.masters_for(pg["params"])
    if optimizer.state:
        # state built before wrap (a step taken or a state dict loaded): move it to the masters
        moved: defaultdict[torch.Tensor, Any] = defaultdict(dict)
        for param, value in optimizer.state.items():
            master = group.masters.get(id(param), param)
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
        optimizer.state = moved
    optimizer._mixprec = st  # type: ignore[attr-defined]
    optimizer.__class__ = _subclass_for(type(optimizer))
    if rewrap:
        _rewrap_scheduler_step(optimizer)
    group.states.append(weakref.ref(st))
    return st
