"""Wrap-time recipes for distributed training: DDP's reduce dtype and FSDP2 under a policy.

The per-step found_inf all-reduce that makes every rank skip together is
:mod:`mixprec_torch.step.distributed`'s.

DDP recipe
    Wrap first, then hand the converted model to DDP, so that DDP builds its gradient buckets
    over the parameters in their final dtype::

        model, optimizer = mixprec.torch.wrap(model, optimizer, policy="O2-bf16")
        ddp_model = DistributedDataParallel(model)
        register_ddp_reduce_hook(ddp_model, policy)   # optional: reduce in policy.reduce

    DDP reduces gradients in the dtype of the parameters (bfloat16 under O2-bf16). The
    optional :func:`register_ddp_reduce_hook` makes the all-reduce run in the policy's
    ``reduce`` dtype instead (float32 by default), which is what the policy promises.

FSDP2 recipe (``torch.distributed.fsdp.fully_shard``)
    FSDP2 already does module-level mixed precision: it keeps the *sharded* parameters in
    their original dtype, casts them to ``param_dtype`` when it gathers them for forward and
    backward, reduce-scatters gradients in ``reduce_dtype`` and leaves float32 gradients on
    the float32 shards. Those sharded float32 parameters are exactly what mixprec's master
    weights would be, so under FSDP2 mixprec does not cast parameters and keeps no copies:

        fully_shard_with_policy(model, policy, blocks=model.layers)   # 1. shard (fp32 model)
        optimizer = torch.optim.AdamW(model.parameters())              # 2. optimizer on shards
        model, optimizer = mixprec.torch.wrap(model, optimizer, policy=policy)   # 3. wrap

    ``wrap`` recognises a model managed by FSDP2 (:func:`is_fsdp_managed`: an
    ``FSDPModule`` inside it or ``DTensor`` parameters) and then leaves parameter dtypes,
    master weights and the model-boundary casts to FSDP; it keeps what FSDP does not do:
    op-level casting for O1 policies (``torch.autocast`` inside the sharded modules works as
    usual), loss scaling, unscaling the local gradient shards (:func:`local_tensor`), the
    found_inf all-reduce and the skip. Calling ``wrap`` *before* ``fully_shard`` is not
    supported: ``fully_shard`` replaces the parameters, so any masters would point at
    parameters the model no longer uses.

    Modules the policy pins to another dtype (``*BatchNorm*`` to float32 under O1/O2) get a
    ``fully_shard`` of their own with that ``param_dtype`` and an ``output_dtype`` equal to
    the dtype around them, so the next low-precision layer receives the dtype it expects.

    Under O3 (no masters) the shards keep the dtype the model had when it was sharded: shard a
    float32 model and FSDP's float32 shards still act as masters; cast the model first
    (``model.to(torch.bfloat16)``) for a pure low-precision run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from mixprec.errors import PolicyError, WrapError
from mixprec.kit import get_policy, widest

from ..dtypes import dtype_name, torch_dtype
from ..sites import plan_model
from ..torch_private import fsdp_mixed_precision

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from mixprec.kit import Policy

__all__ = [
    "check_fsdp_policy",
    "check_user_mixed_precision",
    "ddp_reduce_hook",
    "fsdp_mixed_precision_policy",
    "fsdp_policy_of",
    "fully_shard_with_policy",
    "is_fsdp_managed",
    "local_tensor",
    "register_ddp_reduce_hook",
]

# Attribute set on a root sharded by fully_shard_with_policy, so that wrap can check that it
# is given the same policy.
_POLICY_ATTR = "_mixprec_fsdp_policy"
# Attribute wrap sets on the models it converted (mixprec_torch.wrapping.wrap's ModelRecord).
_WRAPPED_ATTR = "_mixprec"


# --------------------------------------------------------------------------------------------
# DTensor / FSDP2 detection


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - builds without distributed
        return None
    return DTensor


def _fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - builds without distributed
        return None
    return FSDPModule


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds: the local shard of a ``DTensor``, else itself.

    The local shard shares storage with the ``DTensor``, so in-place unscaling of
    ``local_tensor(p.grad)`` unscales the sharded gradient. Unscale shards, never the
    ``DTensor`` itself: a foreach kernel on ``DTensor`` gradients makes DTensor replicate the
    one-element ``found_inf`` implicitly (with a warning and a hidden collective).
    """
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(tensor, dtensor):
        return tensor.to_local()  # type: ignore[no-any-return, attr-defined]
    return tensor


def is_fsdp_managed(module: torch.nn.Module) -> bool:
    """True when FSDP2 manages ``module`` or a part of it (``FSDPModule`` or DTensor params).

    ``wrap`` uses this to leave parameter dtypes, master weights and boundary casts to FSDP.
    """
    fsdp_module = _fsdp_module_type()
    if fsdp_module is not None and any(isinstance(m, fsdp_module) for m in module.modules()):
        return True
    dtensor = _dtensor_type()
    return dtensor is not None and any(isinstance(p, dtensor) for p in module.parameters())


def fsdp_policy_of(module: torch.nn.Module) -> Policy | None:
    """The mixprec ``Policy`` :func:`fully_shard_with_policy` sharded ``module`` with, if any."""
    return getattr(module, _POLICY_ATTR, None)


def check_fsdp_policy(module: torch.nn.Module, policy: Policy) -> None:
    """Refuse to ``wrap`` a model that :func:`fully_shard_with_policy` sharded under another
    policy: FSDP already casts to that policy's dtypes, and mixprec would scale, save and
    report under this one.

    A model sharded by a plain ``fully_shard`` has its ``MixedPrecisionPolicy`` read instead
    (:func:`check_user_mixed_precision`).

    :raises WrapError: naming both policies, or FSDP's dtype and the policy's.
    """
    if not any(fsdp_policy_of(m) is not None for m in module.modules()):
        check_user_mixed_precision(module, policy)
    for name, mod in module.named_modules():
        sharded = fsdp_policy_of(mod)
        if sharded is not None and sharded != policy:
            where = f"its submodule {name!r}" if name else "the model"
            raise WrapError(
                f"{where} was sharded by fully_shard_with_policy under policy {sharded} "
                f"but wrap resolved policy {policy}; wrap with the policy it was sharded "
                "with, or shard it again with this one"
            )


def check_user_mixed_precision(module: torch.nn.Module, policy: Policy) -> None:
    """Refuse a model whose own ``fully_shard(mp_policy=...)`` computes in another dtype than
    ``policy``: FSDP2 casts the gathered parameters to its ``param_dtype`` (the shards' own
    dtype when None), and mixprec would scale, save and report under a policy that is not
    what runs (float16 with no loss scaling under ``O2-bf16``).

    The outermost FSDP modules' dtype (the root's, or that of a sharded submodule with no
    FSDP module above it, as in a LightningModule whose ``configure_model`` shards
    ``self.net``) must be the policy's ``param`` dtype; one inside another FSDP module may
    also be float32 (an island such as a BatchNorm). Under policies that keep float32
    parameters (O0, O1) every FSDP module must compute in float32, as the op casting expects.

    :raises WrapError: naming the module, FSDP's dtype, the policy and the recipe.
    """
    want = policy.param
    sharded: list[str] = []
    for name, mod in module.named_modules():
        mp = fsdp_mixed_precision(mod)
        if mp is None:
            continue
        outermost = not any(not up or name.startswith(f"{up}.") for up in sharded)
        sharded.append(name)
        own = next((p.dtype for p in mod.parameters()), torch.float32)
        dtype = dtype_name(mp.param_dtype if mp.param_dtype is not None else own)
        allowed = {want} if outermost or want == "float32" else {want, "float32"}
        if dtype in allowed:
            continue
        where = f"submodule {name!r}" if name else "the model"
        raise WrapError(
            f"{where} was sharded with fully_shard(mp_policy=MixedPrecisionPolicy("
            f"param_dtype={mp.param_dtype})), so FSDP computes in {dtype}, but wrap resolved "
            f"policy {policy}, whose parameters are {want}: mixprec would scale, check and "
            "report under a policy that is not what runs. Nothing was converted. Shard with "
            "the policy's settings: mixprec.torch.fully_shard_with_policy(model, policy) (or "
            "fully_shard(module, mp_policy=mixprec.torch.fsdp_mixed_precision_policy(policy))), "
            "or wrap with the policy that matches FSDP's dtype"
        )


# --------------------------------------------------------------------------------------------
# Policy translation


def _resolved_policy(policy: Any) -> Policy:
    """A concrete ``Policy`` from a Policy, preset name, key string or mapping."""
    resolved = get_policy(policy)
    if not resolved.is_resolved:
        raise PolicyError(
            f"policy {str(resolved)!r} still has compute='auto'; FSDP needs concrete dtypes. "
            "Pass a preset such as 'O2-bf16', or resolve it first with "
            "mixprec.resolve_auto(policy, mixprec.torch.capabilities().preferred_lowp(device))."
        )
    return resolved


def fsdp_mixed_precision_policy(
    policy: Any,
    *,
    param: str | None = None,
    output: str | None = None,
    cast_forward_inputs: bool = True,
) -> MixedPrecisionPolicy:
    """Translate a mixprec policy into FSDP2's ``MixedPrecisionPolicy``.

    ``param`` → ``param_dtype`` (the dtype FSDP gathers parameters in and computes with),
    ``reduce`` → ``reduce_dtype`` (the reduce-scatter dtype), ``output`` → ``output_dtype``;
    ``cast_forward_inputs`` stays on so floating inputs meet parameters of their dtype.
    ``param``/``output`` override the policy's dtypes (used for pinned modules). ``policy``
    may be a ``Policy`` or anything ``mixprec.get_policy`` accepts, but not unresolved
    ``auto``.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    resolved = _resolved_policy(policy)
    return MixedPrecisionPolicy(
        param_dtype=torch_dtype(param or resolved.param),
        reduce_dtype=torch_dtype(resolved.reduce),
        output_dtype=torch_dtype(output or resolved.output),
        cast_forward_inputs=cast_forward_inputs,
    )


def fully_shard_with_policy(
    module: torch.nn.Module,
    policy: Any,
    *,
    blocks: Iterable[torch.nn.Module] = (),
    **fully_shard_kwargs: Any,
) -> torch.nn.Module:
    """Apply FSDP2's ``fully_shard`` to ``module`` with the mixed precision ``policy`` says.

    Shards bottom-up: each of ``blocks`` (for example the transformer layers) with the policy's
    dtypes, each module the policy pins to another dtype (``*BatchNorm*`` → float32 under
    O1/O2) with that dtype and ``output_dtype`` equal to the dtype around it, and finally
    ``module`` itself with ``output_dtype = policy.output``. ``fully_shard_kwargs``
    (``mesh``, ``reshard_after_forward``, ...) go to every ``fully_shard`` call. Returns
    ``module`` (sharded in place). Create the optimizer afterwards, from
    ``module.parameters()``, then call ``mixprec.torch.wrap(module, optimizer, policy)``.
    """
    from torch.distributed.fsdp import fully_shard

    if any(hasattr(m, _WRAPPED_ATTR) for m in module.modules()):
        raise WrapError(
            "fully_shard_with_policy got a model already converted by mixprec.torch.wrap; "
            "fully_shard replaces the parameters, so shard first, then create the optimizer, "
            "then wrap: fully_shard_with_policy(model, policy); optimizer = ...; "
            "model, optimizer = mixprec.torch.wrap(model, optimizer, policy)"
        )
    resolved = _resolved_policy(policy)
    block_ids = {id(b) for b in blocks}
    # Decide everything before sharding (fully_shard changes class names: FSDPLinear...),
    # with the plan wrap uses; children before parents, as fully_shard needs.
    plan = [
        (site.module, site.dtype, site.outer)
        for site in reversed(plan_model(module, resolved)[1:])
        if (site.dtype != site.outer or id(site.module) in block_ids)
        and any(True for _ in site.module.parameters())
    ]
    for mod, param, outer in plan:
        mp = fsdp_mixed_precision_policy(resolved, param=param, output=outer)
        if param != resolved.param:
            # A pinned island: reduce at least as wide as it computes.
            mp = type(mp)(
                param_dtype=mp.param_dtype,
                reduce_dtype=torch_dtype(widest([param, resolved.reduce])),
                output_dtype=mp.output_dtype,
                cast_forward_inputs=True,
            )
        fully_shard(mod, mp_policy=mp, **fully_shard_kwargs)
    fully_shard(module, mp_policy=fsdp_mixed_precision_policy(resolved), **fully_shard_kwargs)
    setattr(module, _POLICY_ATTR, resolved)
    return module


# --------------------------------------------------------------------------------------------
# DDP gradient reduction dtype


def ddp_reduce_hook(
    policy: Any,
) -> Callable[[Any, Any], torch.futures.Future[torch.Tensor]]:
    """A DDP communication hook that all-reduces each bucket in ``policy.reduce``.

    The bucket is cast to the reduce dtype, summed across ranks, divided by the world size
    (DDP's averaging) and cast back into the bucket. Buckets already in the reduce dtype are
    reduced in place without copies. Register with ``ddp_model.register_comm_hook(group,
    hook)`` or use :func:`register_ddp_reduce_hook`.
    """
    reduce_dtype = torch_dtype(_resolved_policy(policy).reduce)

    def hook(group: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        group = group if group is not None else torch.distributed.group.WORLD
        world = torch.distributed.get_world_size(group)
        buffer: torch.Tensor = bucket.buffer()
        wire = buffer if buffer.dtype == reduce_dtype else buffer.to(reduce_dtype)
        wire.div_(world)
        work = torch.distributed.all_reduce(wire, group=group, async_op=True)

        def back(fut: torch.futures.Future[Any]) -> torch.Tensor:
            if wire is not buffer:
                buffer.copy_(wire)
            return buffer

        return work.get_future().then(back)  # type: ignore[no-any-return]

    # DDP inspects the hook's annotations and compares them with the real classes; with
    # postponed evaluation (``from __future__ import annotations``) they would be strings.
    hook.__annotations__ = {
        "group": Any,
        "bucket": torch.distributed.GradBucket,  # type: ignore[attr-defined]
        "return": torch.futures.Future[torch.Tensor],
    }
    return hook


def register_ddp_reduce_hook(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    policy: Any,
    group: Any | None = None,
) -> None:
    """Make ``ddp_model`` reduce gradients in ``policy.reduce`` (see :func:`ddp_reduce_hook`)."""
    ddp_model.register_comm_hook(group, ddp_reduce_hook(policy))
