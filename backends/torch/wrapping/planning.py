"""The first half of ``wrap``: validate everything and decide what will change.

Everything that can be refused is checked here, before anything is changed, so a ``wrap``
that raises leaves the models, the optimizers and their state exactly as they were:

1. shapes and types (:func:`check_arguments`): models are ``nn.Module`` s (not yet under
   DDP, DataParallel, FSDP1 or ``torch.compile``, and not wrapped before), optimizers are
   ``torch.optim.Optimizer`` s or optimizer wrappers shaped like one (LARC, Lookahead: an
   object with ``param_groups``, ``state``, ``step`` and ``zero_grad``), not wrapped before,
   their ``step`` not replaced, holding only parameters of the given models;
2. the policy, resolved for the device of the first parameter (by
   :func:`~mixprec_torch.wrapping.wrap.wrap` itself);
3. the plan (:func:`plan_wrap`): a model sharded by FSDP2 under another policy is refused,
   module dtypes and tied weights are decided (:mod:`mixprec_torch.sites`), every parameter
   and buffer must live on a device that computes the policy's dtypes, and lint: loss
   scaling without masters for low-precision parameters is refused, an Adam ``eps`` that
   underflows in the state dtype warns (:class:`mixprec.MixprecWarning`); under O1, a
   kernel another library (or the user's own ``torch.library`` code) registered at an
   Autocast key for an operator the policy decides is refused by name
   (:func:`mixprec_torch.o1.autocast_kernels.foreign`), before mixprec would replace it.

The result, a :class:`WrapPlan`, is what :mod:`mixprec_torch.wrapping.wrap` applies.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.errors import MixprecWarning, UnsupportedDtypeError, WrapError
from mixprec.kit import (
    FLOAT32,
    Policy,
    check_adam_eps,
    check_scaler_without_masters,
    is_low_precision,
    parse_state_format,
)

from ..copies import CopyOnly
from ..devices import capabilities, device_capability
from ..dtypes import dtype_name, refuse_complex
from ..fp8.layers import FP8Layers, plan_fp8
from ..lowbit.shards import refusal as sharding_refusal
from ..lowbit.state import supported_optimizer
from ..o1.autocast import OpCasting
from ..o1.autocast_kernels import foreign
from ..step.checkpoint import ModelCheckpoint
from ..step.optimizer import check_patchable
from ..step.optimizer_state import WrapGroup
from ..torch_private import compiled_inner
from .casting import ModelCasting
from .sharding import check_fsdp_policy, is_fsdp_managed

__all__ = ["ModelRecord", "WrapPlan", "check_arguments", "first_device", "plan_wrap"]

_ADAM_LIKE = ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "SparseAdam")


class ModelRecord(CopyOnly):
    """What ``wrap`` attached to a model (``model._mixprec``).

    ``copy.deepcopy(model)`` copies it with the model (the copy keeps exact masters);
    pickling it raises :class:`~mixprec.errors.CheckpointError` naming the fix."""

    def __init__(
        self, group: WrapGroup, casting: ModelCasting, checkpoint: ModelCheckpoint
    ) -> None:
        self.group = group
        self.casting = casting
        self.checkpoint = checkpoint

    @property
    def policy(self) -> Policy:
        return self.group.policy


@dataclass
class WrapPlan:
    """Everything ``wrap`` decided, before it changes anything."""

    models: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    params: dict[int, tuple[str, nn.Parameter]]
    """id(param) -> (qualified name, param): every parameter of the models, first name kept."""
    policy: Policy
    device: torch.device
    fsdp: bool
    """FSDP2 manages a model: it casts parameters and boundaries and its shards are masters."""
    castings: list[ModelCasting]
    """One per model, its op casting set; not installed yet."""
    planned: dict[int, str]
    """id(param) -> the dtype the plan gives it (empty under FSDP2 and ``keep_dtypes``: each
    parameter keeps its own dtype)."""
    fp8: FP8Layers | None = None
    """The layers that run as FP8 GEMMs (policies with ``fp8``); not installed yet."""

    @property
    def masters_on(self) -> bool:
        """Whether separate master copies are kept: never under FSDP2, and never without an
        optimizer (inference keeps no float32 copy: nothing would update it). Under a
        compensated strategy they are the float32 working masters, whose storage lives only
        in step()."""
        strategy = self.policy.master_strategy is not None
        return (self.policy.uses_masters or strategy) and not self.fsdp and bool(self.optimizers)


def check_arguments(
    models: Sequence[Any], optimizers: Sequence[Any]
) -> dict[int, tuple[str, nn.Parameter]]:
    """Check the models and optimizers ``wrap`` got; return their parameters by id.

    :raises WrapError: naming the model or optimizer and the fix.
    """
    _check_models(models)
    params: dict[int, tuple[str, nn.Parameter]] = {}
    for index, model in enumerate(models):
        prefix = f"model{index}." if len(models) > 1 else ""
        for name, param in model.named_parameters(remove_duplicate=False):
            params.setdefault(id(param), (prefix + name, param))
    _check_optimizers(optimizers, params)
    refuse_complex(optimizers, params)
    return params


def plan_wrap(
    models: list[nn.Module],
    optimizers: list[torch.optim.Optimizer],
    params: dict[int, tuple[str, nn.Parameter]],
    policy: Policy,
    device: torch.device,
    *,
    keep_dtypes: bool = False,
) -> WrapPlan:
    """Decide every dtype, hook and master under the resolved ``policy``; refuse what cannot
    be wrapped. Changes nothing.

    ``keep_dtypes``: every parameter and buffer keeps its own dtype (``policy.param`` and
    module pins cast nothing, inputs are not cast at the boundary); the parameters that are
    low precision get masters where the policy keeps masters.

    :raises WrapError: a model sharded under another policy, tied weights in two dtypes,
        loss scaling without masters for low-precision parameters.
    :raises UnsupportedDtypeError: a parameter on a device that cannot compute the policy.
    """
    for model in models:
        check_fsdp_policy(model, policy)
    fsdp = any(is_fsdp_managed(m) for m in models)
    if fsdp and policy.master_strategy is not None:
        raise WrapError(
            f"master={policy.master_strategy} (policy {policy.label}) is not supported with "
            "FSDP2: the shards would need their own compensation state. Use 'O2-bf16' "
            "(float32 masters) or 'O3-bf16' with FSDP2, or train without FSDP2"
        )
    # not cast: FSDP2 casts parameters itself; keep_dtypes leaves them as they are. Either
    # way the plan's dtype of a parameter is then its own (planned stays empty)
    cast_params = not fsdp and not keep_dtypes
    castings = [ModelCasting(model, policy, None, cast_params=cast_params) for model in models]
    planned: dict[int, str] = {}
    if cast_params:
        for casting in castings:
            planned.update(casting.planned_dtype())
    _check_devices(models, policy, planned)
    if _needs_op_casting(policy):
        for model, casting in zip(models, castings, strict=True):
            op_casting = OpCasting(policy, _device_types([model]))
            _check_kernels(op_casting)
            casting.set_op_casting(op_casting)
    fp8 = plan_fp8([casting.sites for casting in castings], policy, fsdp=fsdp)
    plan = WrapPlan(models, optimizers, params, policy, device, fsdp, castings, planned, fp8)
    names = {pid: name for pid, (name, _) in params.items()}
    _lint(optimizers, policy, names, planned, plan.masters_on)
    _check_lowbit(optimizers, policy, names)
    return plan


def _check_lowbit(
    optimizers: Sequence[torch.optim.Optimizer], policy: Policy, names: dict[int, str]
) -> None:
    """Refuse a low-bit ``state`` for optimizers whose state it cannot quantize, and for a
    parameter sharded otherwise than by rows (FSDP2's ``Shard(0)``, ``Replicate`` on other
    mesh dimensions), whose shards the state cannot quantize one by one."""
    fmt = parse_state_format(policy.state) if policy.state is not None else None
    if fmt is None:
        return
    for opt in optimizers:
        supported_optimizer(opt, getattr(type(opt), "_mixprec_base", type(opt)), fmt)
        for group in opt.param_groups:
            for param in group["params"]:
                name = names.get(id(param))
                why = sharding_refusal(param)
                if why is None or not fmt.quantizes(param.numel(), name):
                    continue
                raise WrapError(
                    f"state={fmt} quantizes each rank's shard of a parameter FSDP2 shards by "
                    f"rows (Shard(0)), but parameter {name!r} is sharded with {why} (a "
                    "shard_placement_fn, or tensor parallelism). Shard it by rows, keep its "
                    f"state in float32 (state={fmt.name}(keep={name})), or drop state=..."
                )


def _wrapped_parallel(model: nn.Module) -> str | None:
    if compiled_inner(model) is not None:
        return "torch.compile"
    if isinstance(model, nn.DataParallel):
        return "DataParallel"
    if torch.distributed.is_available():
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(model, DistributedDataParallel):
            return "DistributedDataParallel"
        try:
            from torch.distributed.fsdp import FullyShardedDataParallel
        except ImportError:  # pragma: no cover - builds without FSDP
            return None
        if isinstance(model, FullyShardedDataParallel):
            return "FullyShardedDataParallel (FSDP1)"
    return None


def _check_models(models: Sequence[Any]) -> None:
    if not models:
        raise WrapError("wrap needs at least one model: mixprec.torch.wrap(model, optimizer)")
    for index, model in enumerate(models):
        if not isinstance(model, nn.Module):
            raise WrapError(
                f"model {index} is a {type(model).__name__}, not a torch.nn.Module; pass the "
                "model (or a list of models) first, then the optimizer(s): "
                "wrap(model, optimizer, policy=...)"
            )
        wrapper = _wrapped_parallel(model)
        if wrapper == "torch.compile":
            raise WrapError(
                f"model {index} is already compiled with torch.compile; wrap the plain model "
                "first, then compile: model, opt = mixprec.torch.wrap(model, opt); "
                "model = torch.compile(model)"
            )
        if wrapper is not None and wrapper.startswith("FullyShardedDataParallel"):
            raise WrapError(
                f"model {index} is wrapped in FullyShardedDataParallel (FSDP1), which mixprec "
                "does not support in either order (its flat parameters replace the ones wrap "
                "converts). Use FSDP2 on the bare float32 model: "
                "mixprec.torch.fully_shard_with_policy(model, policy); optimizer = "
                "torch.optim.AdamW(model.parameters()); model, optimizer = "
                "mixprec.torch.wrap(model, optimizer, policy)"
            )
        if wrapper is not None:
            raise WrapError(
                f"model {index} is already wrapped in {wrapper}; mixprec must convert the bare "
                f"model first, then hand it to {wrapper.split(' ')[0]}: "
                "model, opt = mixprec.torch.wrap(model, opt, policy=...); "
                f"model = {wrapper.split(' ')[0]}(model)"
            )
        for name, sub in model.named_modules():
            if isinstance(getattr(sub, "_mixprec", None), ModelRecord):
                where = f"its submodule {name!r}" if name else "it"
                raise WrapError(
                    f"model {index} cannot be wrapped: {where} was already wrapped by "
                    "mixprec.torch.wrap. Wrap each model once, and pass every model and "
                    "optimizer that train together to a single wrap call; to change the "
                    "policy, build a fresh model and optimizer"
                )
    ids = [id(m) for m in models]
    for i, model in enumerate(models):
        for j, other in enumerate(models):
            if i != j and any(sub is other for sub in model.modules()):
                raise WrapError(
                    f"model {j} is a submodule of model {i}; pass only the outer model (or "
                    "models that do not contain each other)"
                )
    if len(set(ids)) != len(ids):
        raise WrapError("the same model was passed twice to wrap; pass each model once")


def _check_optimizers(
    optimizers: Sequence[Any], params: dict[int, tuple[str, nn.Parameter]]
) -> None:
    for index, opt in enumerate(optimizers):
        if not isinstance(opt, torch.optim.Optimizer) and not _optimizer_like(opt):
            raise WrapError(
                f"optimizer {index} is a {type(opt).__name__}, not a torch.optim.Optimizer nor "
                "an optimizer wrapper (an object with param_groups, a list of dicts with "
                "'params', a state dict and a step method, like LARC or Lookahead); call "
                "wrap(model, optimizer) or wrap([models], [optimizers])"
            )
        if hasattr(opt, "_mixprec"):
            raise WrapError(
                f"optimizer {index} ({type(opt).__name__}) was already wrapped by "
                "mixprec.torch.wrap; wrap each optimizer once, together with its models"
            )
        check_patchable(opt)  # a step replaced by anything but an LR scheduler: refused
        strangers = [
            (g, tuple(p.shape))
            for g, group in enumerate(opt.param_groups)
            for p in group["params"]
            if id(p) not in params
        ]
        if strangers:
            shown = ", ".join(f"group {g} shape {list(s)}" for g, s in strangers[:5])
            raise WrapError(
                f"optimizer {index} ({type(opt).__name__}) holds {len(strangers)} parameter(s) "
                f"that are not in the models given to wrap ({shown}); pass every model whose "
                "parameters it updates: wrap([model_a, model_b], optimizer)"
            )
    if len({id(o) for o in optimizers}) != len(optimizers):
        raise WrapError("the same optimizer was passed twice to wrap; pass each optimizer once")


def _optimizer_like(opt: Any) -> bool:
    """Whether ``opt`` is shaped like an optimizer (a wrapper such as LARC or Lookahead
    that is no ``torch.optim.Optimizer``): what the step and the masters need of it."""
    groups = getattr(opt, "param_groups", None)
    return (
        isinstance(groups, list)
        and all(isinstance(g, dict) and "params" in g for g in groups)
        and isinstance(getattr(opt, "state", None), dict)
        and callable(getattr(opt, "step", None))
        and callable(getattr(opt, "zero_grad", None))
    )


def first_device(models: Sequence[nn.Module]) -> torch.device:
    for model in models:
        for tensor in (*model.parameters(), *model.buffers()):
            if tensor.is_floating_point():
                return tensor.device
    return torch.device("cpu")


def _check_devices(models: Sequence[nn.Module], policy: Policy, planned: dict[int, str]) -> None:
    needed = {policy.compute, *planned.values()}
    for index, model in enumerate(models):
        for kind, items in (
            ("parameter", model.named_parameters()),
            ("buffer", model.named_buffers()),
        ):
            for name, tensor in items:
                device = tensor.device
                cap = device_capability(device)
                if cap is None:
                    fix = (
                        "materialise it first (model.to_empty(device=...) and load weights)"
                        if device.type == "meta"
                        else "move the model to the CPU or a CUDA device before wrap"
                    )
                    raise UnsupportedDtypeError(
                        f"{kind} {name!r} of model {index} is on device {device}, where the "
                        f"torch backend cannot compute; {fix}. Devices here: "
                        f"{', '.join(c.device for c in capabilities().devices)}"
                    )
                missing = sorted(d for d in needed if d not in cap.compute_dtypes)
                if missing:
                    why = f" ({cap.note})" if cap.note else ""
                    raise UnsupportedDtypeError(
                        f"policy {policy} needs {', '.join(missing)} but {cap.device}{why}, "
                        f"where {kind} {name!r} of model {index} lives, computes only in "
                        f"{', '.join(cap.compute_dtypes)}; use a policy with "
                        f"compute={'float16' if 'float16' in cap.compute_dtypes else 'float32'} "
                        "(e.g. 'O1' instead of 'O1-bf16'), or another device"
                    )


def _device_types(models: Sequence[nn.Module]) -> tuple[str, ...]:
    types = []
    for model in models:
        for tensor in (*model.parameters(), *model.buffers()):
            if tensor.device.type not in types:
                types.append(tensor.device.type)
    if not types:
        types.append("cpu")
    return tuple(types)


def _lint(
    optimizers: Sequence[torch.optim.Optimizer],
    policy: Policy,
    names: dict[int, str],
    planned: dict[int, str],
    masters_on: bool,
) -> None:
    """Refuse loss scaling without masters for low-precision params; warn on Adam's eps."""
    master = (FLOAT32 if policy.master_strategy else policy.master) if masters_on else None
    lowp_direct: list[str] = []
    for opt in optimizers:
        worst: str | None = None
        for group in opt.param_groups:
            state_dtypes: set[str] = set()
            for p in group["params"]:
                dtype = planned.get(id(p), dtype_name(p.dtype))
                state = master if master is not None and dtype != master else dtype
                has_master = state != dtype
                if is_low_precision(dtype) and not has_master:
                    lowp_direct.append(names[id(p)])
                state_dtypes.add(state)
            eps = group.get("eps")
            if type(opt).__name__ in _ADAM_LIKE and isinstance(eps, (int, float)):
                for state in sorted(state_dtypes):
                    message = check_adam_eps(f"torch.optim.{type(opt).__name__}", eps, state)
                    if message is not None:
                        worst = message
        if worst is not None:
            warnings.warn(worst, MixprecWarning, stacklevel=5)
    unique = list(dict.fromkeys(lowp_direct))
    check_scaler_without_masters(policy, unique)


def _check_kernels(casting: OpCasting) -> None:
    """Refuse a policy whose kernels would replace another library's (or the user's own)."""
    taken = foreign(casting.claims())
    if taken:
        shown = "; ".join(taken[:6]) + ("; ..." if len(taken) > 6 else "")
        raise WrapError(
            f"policy {casting.policy.label} decides these operators at torch's autocast "
            f"dispatch key, where another kernel is registered already: {shown}. mixprec "
            "will not replace it. Remove that registration (do not import the library that "
            "makes it, or destroy your own torch.library.Library), or use a policy that "
            "leaves these op families to torch.autocast (their lists as autocast has them)"
        )


def _needs_op_casting(policy: Policy) -> bool:
    return policy.casts_ops or bool(policy.ops.banned) or any(r.ops for r in policy.modules)
