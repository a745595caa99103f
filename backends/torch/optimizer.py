"""The step: unscale, finite check, skip or step, scale update, master-to-model copy.

``wrap`` swaps each optimizer's class for a subclass of its own class (made once per class,
same name and module), so ``isinstance``, LR schedulers and ``zero_grad(set_to_none=...)``
keep working. The subclass overrides ``step``, ``zero_grad``, ``add_param_group``,
``state_dict`` and ``load_state_dict``; the optimizer's ``param_groups`` hold the float32
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
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from mixprec.errors import CheckpointError, MixprecWarning, StepOrderError, WrapError
from mixprec.policy import Policy
from mixprec.scaler import LossScaler, MixprecState
from mixprec.step import Stage, StepTracker

__all__ = [
    "MixprecState",
    "OptimizerState",
    "Round",
    "WrapGroup",
    "master_params",
    "optimizer_state",
    "patch_optimizer",
    "scale_loss",
    "state",
    "unscale_",
]

_STATE_KEY = "mixprec"
_FORMAT = 1


class Round:
    """One skip-or-step decision, shared by the optimizers unscaled for it."""

    __slots__ = ("pending", "skipped")

    def __init__(self, skipped: bool, pending: set[int]) -> None:
        self.skipped = skipped
        self.pending = pending


class WrapGroup:
    """The optimizers (and models) of one ``wrap`` call: one loss scaler, one policy."""

    def __init__(self, policy: Policy, scaler: LossScaler, device: str) -> None:
        self.policy = policy
        self.scaler = scaler
        self.device = device
        self.states: list[weakref.ReferenceType[OptimizerState]] = []
        self.masters: dict[int, torch.Tensor] = {}
        """id(model param) -> its master (the param itself where no copy is kept)."""
        self.model_params: dict[int, torch.nn.Parameter] = {}
        """id(model param) -> model param, every parameter of the wrapped models."""

    def live_states(self) -> list[OptimizerState]:
        alive = [s() for s in self.states]
        return [s for s in alive if s is not None]


class OptimizerState:
    """What mixprec keeps per optimizer (stored as ``optimizer._mixprec``)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        group: WrapGroup,
        copied: list[tuple[torch.nn.Parameter, torch.Tensor]],
        *,
        local: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.optimizer: Callable[[], torch.optim.Optimizer | None] = weakref.ref(optimizer)
        self.group = group
        self.tracker = StepTracker()
        self.copied = copied
        """(model param, master) pairs whose master is a separate float32 copy."""
        self.local = local
        """Maps a gradient to the part this rank holds (DTensor shards under FSDP2)."""
        self.found_inf: list[torch.Tensor] = []
        self.round: Round | None = None
        self.implicit_unscale = False

    # ------------------------------------------------------------------ gradients

    def copy_grads_to_masters(self) -> None:
        """Cast the model gradients into the masters' float32 gradients (None stays None)."""
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for param, master in self.copied:
            grad = param.grad
            if grad is None:
                master.grad = None
                continue
            if grad.is_sparse:
                master.grad = grad.to(master.dtype)
                continue
            if master.grad is None or master.grad.shape != master.shape:
                master.grad = torch.empty_like(master)
            dst.append(master.grad)
            src.append(grad)
        if dst:
            with torch.no_grad():
                torch._foreach_copy_(dst, src)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale the gradients the optimizer will apply, in place, and record overflow.

        One fused ``_amp_foreach_non_finite_check_and_unscale_`` per (device, dtype); the
        overflow flags stay on the device (no host sync here).
        """
        self.copy_grads_to_masters()
        scaler = self.group.scaler
        by_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
            lambda: defaultdict(list)
        )
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None:
                        continue
                    if self.local is not None:
                        grad = self.local(grad)
                    if grad.is_sparse:
                        if grad.dtype is torch.float16:
                            param.grad = grad = grad.coalesce()
                        grad = grad._values()
                    by_device[grad.device][grad.dtype].append(grad)
            inv = 1.0 / scaler.scale if scaler.enabled else 1.0
            found_list = []
            for device, per_dtype in by_device.items():
                found = torch.zeros(1, dtype=torch.float32, device=device)
                inv_scale = torch.full((), inv, dtype=torch.float32, device=device)
                for grads in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale)
                found_list.append(found)
        self.found_inf = found_list


# ------------------------------------------------------------------------------------------
# The patched optimizer class
# ------------------------------------------------------------------------------------------


def optimizer_state(optimizer: Any, what: str = "this call") -> OptimizerState:
    """The mixprec state of a wrapped optimizer; WrapError naming the fix otherwise."""
    st = getattr(optimizer, "_mixprec", None)
    if not isinstance(st, OptimizerState):
        raise WrapError(
            f"{what} needs an optimizer wrapped by mixprec.torch.wrap, got "
            f"{type(optimizer).__name__}; wrap it first: "
            "model, optimizer = mixprec.torch.wrap(model, optimizer, policy=...)"
        )
    return st


def _all_reduce(found: torch.Tensor) -> torch.Tensor:
    try:
        from .distributed import all_reduce_found_inf
    except ImportError:  # pragma: no cover - the module ships with the backend
        return found
    return all_reduce_found_inf(found)


def _decide_round(group: WrapGroup, optimizer: torch.optim.Optimizer) -> Round:
    """Unscale every optimizer of the group with a pending backward, update the scaler once."""
    members: list[tuple[OptimizerState, torch.optim.Optimizer]] = []
    for st in group.live_states():
        opt = st.optimizer()
        if opt is None or st.round is not None:
            continue
        tracker = st.tracker
        if tracker.stage is Stage.UNSCALED or tracker.needs_unscale:
            members.append((st, opt))
    flags: list[torch.Tensor] = []
    for st, opt in members:
        if st.tracker.needs_unscale:
            st.unscale(opt)
            if opt is not optimizer:
                st.tracker.on_unscale()
                st.implicit_unscale = True
        flags.extend(st.found_inf)
    if flags:
        found = (
            flags[0]
            if len(flags) == 1
            else torch.stack([f.to(flags[0].device) for f in flags]).sum(0)
        )
        found_inf = bool(_all_reduce(found).item())  # the step's one host sync
    else:
        found_inf = False
    skipped = group.scaler.update(found_inf)
    decision = Round(skipped, {id(st) for st, _ in members})
    for st, _ in members:
        st.round = decision
        st.found_inf = []
    return decision


def _copy_masters_to_model(copied: Sequence[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
    if not copied:
        return
    with torch.no_grad():
        torch._foreach_copy_([p for p, _ in copied], [m for _, m in copied])


def _step(self: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
    """Unscale (unless ``unscale_`` ran), check for inf/NaN, step or skip, update the scale."""
    st = optimizer_state(self, "optimizer.step()")
    if closure is not None:
        raise StepOrderError(
            "optimizer.step(closure) is not supported by mixprec: a closure re-runs the "
            "forward and backward pass outside scale_loss. Compute the loss, call backward "
            "inside scale_loss(loss, optimizer), then call optimizer.step() without a closure"
        )
    tracker = st.tracker
    if st.round is None and not (tracker.stage is Stage.UNSCALED or tracker.needs_unscale):
        tracker.on_step()  # raises the StepOrderError that names what is missing
    decision = st.round if st.round is not None else _decide_round(st.group, self)
    tracker.on_step()
    try:
        if not decision.skipped:
            base = type(self)._mixprec_base
            base.step(self)
            _copy_masters_to_model(st.copied)
    finally:
        tracker.on_update()
        st.round = None
        st.implicit_unscale = False
        decision.pending.discard(id(st))
    return None


_step.hooked = True  # type: ignore[attr-defined]  # torch's profiling wrapper is already inside


def _zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
    """Zero the masters' gradients (the optimizer's params) and the model's gradients."""
    base = type(self)._mixprec_base
    base.zero_grad(self, set_to_none)
    st = getattr(self, "_mixprec", None)
    if st is None:
        return
    model_grads = []
    for param, _ in st.copied:
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
        torch._foreach_zero_(model_grads)


def _add_param_group(self: torch.optim.Optimizer, param_group: dict[str, Any]) -> None:
    """Add a group of *model* parameters; the optimizer receives their masters."""
    st = getattr(self, "_mixprec", None)
    if st is None:  # during __init__ of a re-created instance
        return type(self)._mixprec_base.add_param_group(self, param_group)
    group = st.group
    params = param_group["params"]
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    unknown = [p for p in params if id(p) not in group.model_params]
    if unknown:
        raise WrapError(
            f"add_param_group got {len(unknown)} parameter(s) that are not in the models "
            f"wrapped with this optimizer (shapes {[tuple(p.shape) for p in unknown][:4]}); "
            "pass every model whose parameters the optimizer updates to the same wrap call"
        )
    masters = [group.masters[id(p)] for p in params]
    copied = {id(m) for _, m in st.copied}
    for p, m in zip(params, masters, strict=True):
        if m is not p and id(m) not in copied:
            st.copied.append((p, m))
            copied.add(id(m))
    return type(self)._mixprec_base.add_param_group(self, {**param_group, "params": masters})


def _state_dict(self: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state dict plus mixprec's: scaler, step tracker, resolved policy."""
    base = type(self)._mixprec_base
    sd = base.state_dict(self)
    st = getattr(self, "_mixprec", None)
    if st is not None:
        sd[_STATE_KEY] = {
            "format": _FORMAT,
            "scaler": st.group.scaler.state_dict(),
            "tracker": {"steps": st.tracker.steps},
            "policy": st.group.policy.to_dict(),
        }
    return sd


def _load_state_dict(self: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Load an optimizer state dict; mixprec's part (if any) restores scaler and tracker.

    A plain PyTorch state dict (no ``"mixprec"`` entry) loads too; the scaler then keeps its
    current state.
    """
    from mixprec.policy import Policy

    state_dict = dict(state_dict)
    extra = state_dict.pop(_STATE_KEY, None)
    st = getattr(self, "_mixprec", None)
    if extra is not None and st is not None:
        if not isinstance(extra, dict) or "scaler" not in extra:
            raise CheckpointError(
                "the optimizer state dict's 'mixprec' entry is malformed; save it with "
                "optimizer.state_dict() of an optimizer wrapped by mixprec.torch.wrap"
            )
        saved_policy = extra.get("policy")
        if saved_policy is not None:
            saved = Policy.from_dict(saved_policy)
            if saved != st.group.policy:
                warnings.warn(
                    f"the checkpoint was saved under policy {saved} but this optimizer is "
                    f"wrapped with {st.group.policy}; training continues with the current "
                    "policy. Wrap with the saved policy (optimizer.state_dict()['mixprec']"
                    "['policy']) to resume exactly",
                    MixprecWarning,
                    stacklevel=2,
                )
        # check before mutating anything
        scaler = st.group.scaler
        probe = LossScaler(scaler.state.fresh())
        probe.load_state_dict(extra["scaler"])
    base = type(self)._mixprec_base
    base.load_state_dict(self, state_dict)
    if extra is not None and st is not None:
        st.group.scaler.load_state_dict(extra["scaler"])
        st.tracker.reset()
        st.tracker.steps = int(extra.get("tracker", {}).get("steps", st.tracker.steps))
        st.round = None
        st.found_inf = []


_SUBCLASSES: dict[type, type] = {}


def _subclass_for(cls: type) -> type:
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        namespace = {
            "step": _step,
            "zero_grad": _zero_grad,
            "add_param_group": _add_param_group,
            "state_dict": _state_dict,
            "load_state_dict": _load_state_dict,
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
    copied: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
    seen: set[int] = set()
    remap: dict[int, torch.Tensor] = {}
    for pg in optimizer.param_groups:
        new_params = []
        for param in pg["params"]:
            master = group.masters[id(param)]
            new_params.append(master)
            if master is not param:
                remap[id(param)] = master
                if id(master) not in seen:
                    seen.add(id(master))
                    copied.append((param, master))
        pg["params"] = new_params
    if optimizer.state:
        # state built before wrap (a step taken or a state dict loaded): move it to the masters
        moved: defaultdict[torch.Tensor, Any] = defaultdict(dict)
        for param, value in optimizer.state.items():
            master = remap.get(id(param), param)
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
    st = OptimizerState(optimizer, group, copied, local=local)
    optimizer._mixprec = st  # type: ignore[attr-defined]
    optimizer.__class__ = _subclass_for(type(optimizer))
    if rewrap:
        _rewrap_scheduler_step(optimizer)
    group.states.append(weakref.ref(st))
    return st


# ------------------------------------------------------------------------------------------
# The user API around the step
# ------------------------------------------------------------------------------------------


def _as_list(optimizers: Any) -> list[Any]:
    if optimizers is None:
        return []
    if isinstance(optimizers, (list, tuple)):
        return list(optimizers)
    return [optimizers]


@contextmanager
def scale_loss(loss: torch.Tensor, optimizers: Any) -> Iterator[torch.Tensor]:
    """Yield ``loss`` cast to float32 and multiplied by the loss scale; call ``backward()`` on it.

    ``optimizers`` (one or a list, all from one ``wrap`` call) are the optimizers whose
    parameters this backward pass produces gradients for: they unscale and skip together.
    Several ``scale_loss`` blocks before one ``step()`` accumulate gradients.
    """
    opts = _as_list(optimizers)
    if not opts:
        raise WrapError(
            "scale_loss needs the optimizer(s) whose gradients this loss produces: "
            "scale_loss(loss, optimizer) or scale_loss(loss, [opt_a, opt_b])"
        )
    states = [optimizer_state(opt, "scale_loss") for opt in opts]
    group = states[0].group
    if any(s.group is not group for s in states):
        raise WrapError(
            "scale_loss got optimizers from different wrap calls, which have different loss "
            "scales; wrap every model and optimizer that share a loss in one call: "
            "mixprec.torch.wrap([model_a, model_b], [opt_a, opt_b])"
        )
    if not isinstance(loss, torch.Tensor):
        raise WrapError(f"scale_loss needs the loss as a tensor, got {type(loss).__name__}")
    for st in states:
        if st.round is not None:
            raise StepOrderError(
                "this optimizer took part in a backward pass whose step() is still pending "
                "(another optimizer of the same scale_loss call already stepped); call "
                "step() on every optimizer passed to scale_loss before the next backward pass"
            )
    counted: list[OptimizerState] = []
    try:
        for st in states:
            st.tracker.on_backward()
            counted.append(st)
    except BaseException:
        for st in counted:
            st.tracker.backwards -= 1
        raise
    scaler = group.scaler
    scaled = loss if loss.dtype == torch.float32 else loss.to(torch.float32)
    if scaler.enabled:
        scaled = scaled * scaler.scale
    try:
        yield scaled
    except BaseException:
        for st in counted:
            st.tracker.backwards -= 1
        raise


def unscale_(optimizer: torch.optim.Optimizer) -> None:
    """Divide the optimizer's gradients by the loss scale now (before clipping).

    After it, ``master_params(optimizer)`` hold the true gradients. Call it once per step,
    after the last backward pass; ``step()`` then does not unscale again.
    """
    st = optimizer_state(optimizer, "unscale_")
    if st.round is not None and st.implicit_unscale:
        st.implicit_unscale = False  # another optimizer's step() already unscaled these
        return
    st.tracker.on_unscale()
    st.unscale(optimizer)


def master_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors the optimizer updates: float32 masters, or the model params themselves.

    Clip these (after ``unscale_``): ``clip_grad_norm_(master_params(opt), max_norm)``.
    """
    optimizer_state(optimizer, "master_params")
    return [p for group in optimizer.param_groups for p in group["params"]]


def state(optimizer: torch.optim.Optimizer) -> MixprecState:
    """Loss scale, skip counters, resolved policy and events of the optimizer's group."""
    st = optimizer_state(optimizer, "state")
    return st.group.scaler.snapshot(st.group.policy)
