"""``MixprecPrecision``: mixprec as a Lightning precision plugin.

``lightning.Trainer(plugins=[MixprecPrecision("O2-bf16")])`` trains a ``LightningModule``
under a mixprec policy. The plugin translates Lightning's calls; the policy, the loss
scaler, the masters and the step stay ``mixprec.torch.wrap``'s:

- ``connect`` (after ``configure_optimizers``) calls ``wrap(lightning_module, optimizers,
  policy)``. Schedulers built in ``configure_optimizers`` keep working (``wrap`` re-wraps
  their step counter). Lightning's DDP strategies (``"ddp"``, ``"ddp_spawn"``) wrap the
  module in DDP before ``connect``: the plugin converts the module inside, then has the
  strategy build its DDP again over the converted parameters (the first DDP's buckets were
  laid out for float32); the overflow consensus runs over that DDP's process group.
- FSDP2: Lightning's ``ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)``.
  The module shards itself in ``configure_model`` (before ``connect``) with the plugin's
  :meth:`MixprecPrecision.fully_shard` (``fully_shard_with_policy`` with the plugin's policy,
  ``auto`` resolved for the module's device) or, under policies with float32 parameters
  (O1-bf16, O1, O0), a plain ``fully_shard``; ``connect`` then wraps the LightningModule as
  ``wrap`` does an FSDP2 model (FSDP's float32 shards are the masters; the consensus runs over
  the mesh's group). ``wrap``'s refusal of a sharding that computes in another dtype than the
  policy (a plain ``fully_shard`` under O2-bf16) names the plugin's ``fully_shard``. Trained
  bit for bit as Lightning's ``bf16-mixed`` under the same strategy (O1-bf16 and O2-bf16, two
  CPU ranks); the strategy's DCP and single-file checkpoints resume exactly. Tensor
  parallelism is untested.
- Lightning's ``FSDPStrategy`` (``strategy="fsdp"``, FSDP1) is not supported: Lightning
  accepts only its ``FSDPPrecision`` there (a ``TypeError`` when the Trainer is built) and
  needs a GPU for it, and mixprec does not support FSDP1. A strategy that hands ``connect``
  its module wrapped in anything but DDP gets a ``WrapError`` naming the FSDP2 recipe
  (:data:`FSDP_RECIPE`).
- ``pre_backward`` multiplies the loss by the loss scale (in float32), as ``scale_loss``
  does. Like ``torch.amp.GradScaler`` under Lightning's own ``MixedPrecision`` plugin, a
  backward pass is not tied to an optimizer: the next ``optimizer_step`` (or
  ``clip_gradients``) of each optimizer claims the backward passes since its previous step.
- ``optimizer_step`` runs Lightning's closure itself (forward and backward), unscales,
  runs the ``on_before_optimizer_step`` hooks and gradient clipping on the unscaled float32
  master gradients, then calls ``optimizer.step()`` without a closure: it skips on inf/NaN
  and updates the scale. Lightning counts the call whether or not it skipped, so
  ``trainer.global_step`` advances on a skipped step, as under ``MixedPrecision``.
- an optimizer whose ``step`` needs a closure (``torch.optim.LBFGS``) gets Lightning's
  closure through ``optimizer.step(closure=...)`` instead, under policies without loss
  scaling (bf16 presets, O0): mixprec evaluates it once, then LBFGS's line search re-runs
  it on the masters. The hooks and clipping run after the first evaluation, once per step.
  Under loss scaling (or compensated masters) such an optimizer is refused in ``connect``.
- a ``training_step`` that calls a submodule directly (``self.net(x)``) runs under the
  policy: the entries ``wrap`` gives the module's children
  (:mod:`mixprec_torch.wrapping.boundaries`) open the model's region and cast their inputs and
  outputs when they are called from outside its ``forward``.
- the checkpoint holds the policy and the scaler state under the plugin's name (the
  optimizer state dicts carry the scaler too); ``fit(ckpt_path=...)`` resumes exactly.
- after each step the loss scale and the skip count are logged as ``mixprec/loss_scale``
  and ``mixprec/skipped_steps`` (``log_state=False`` turns that off).

Manual optimization works the same way: ``self.manual_backward(loss)`` scales,
``self.clip_gradients(opt, ...)`` unscales first, ``opt.step()`` steps or skips. Each
optimizer's ``step()`` is one skip decision of its own (a GAN's discriminator and generator
steps after separate backward passes, as with ``GradScaler``).
"""

from __future__ import annotations

import gc
import inspect
import warnings
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mixprec.errors import CheckpointError, MixprecError, MixprecWarning, StepOrderError, WrapError
from mixprec.kit import (
    BFLOAT16,
    LossScaler,
    MixprecState,
    NoScale,
    Policy,
    Stage,
    get_policy,
    is_low_precision,
)

from ..o1.autocast import region
from ..step.loop import master_params, state, unscale_
from ..step.optimizer_state import WrapGroup, optimizer_state
from ..wrapping.sharding import fully_shard_with_policy, is_fsdp_managed
from ..wrapping.wrap import ModelRecord, resolve_policy, wrap

__all__ = ["FABRIC_RECIPE", "FSDP_RECIPE", "MixprecPrecision", "lightning_precision_name"]


FABRIC_RECIPE = (
    "MixprecPrecision is a plugin for lightning.Trainer; Lightning Fabric hands it the model "
    "without its optimizer, and mixprec converts the two together. With Fabric, keep "
    "Fabric's default precision and wrap before setup: model, optimizer = "
    "mixprec.torch.wrap(model, optimizer, policy); model, optimizer = fabric.setup(model, "
    "optimizer); then 'with mixprec.torch.scale_loss(loss, optimizer) as scaled: "
    "fabric.backward(scaled)', mixprec.torch.unscale_(optimizer) before "
    "fabric.clip_gradients(...), and optimizer.step()"
)

FSDP_RECIPE = (
    "for FSDP under Lightning use FSDP2 through "
    "strategy=lightning.pytorch.strategies.ModelParallelStrategy(data_parallel_size=<number of "
    "processes>, tensor_parallel_size=1) and shard in the LightningModule's configure_model: "
    "self.trainer.precision_plugin.fully_shard(self.net, mesh=self.device_mesh['data_parallel']) "
    "(mixprec.torch.fully_shard_with_policy with the plugin's policy; a plain "
    "torch.distributed.fsdp.fully_shard works too under policies that keep float32 parameters, "
    "O1-bf16, O1, O0); MixprecPrecision then wraps the sharded module. Lightning's "
    "FSDPStrategy (strategy='fsdp', FSDP1) takes only its own FSDPPrecision, and mixprec does "
    "not support FSDP1"
)


def lightning_precision_name(policy: Policy) -> str:
    """Lightning's name for what ``policy`` does (``trainer.precision`` reports it)."""
    if not policy.is_resolved:
        return "32-true"
    short = "bf16" if BFLOAT16 in (policy.compute, policy.param) else "16"
    if is_low_precision(policy.param) and policy.master is None:
        return f"{short}-true"
    if is_low_precision(policy.compute) or is_low_precision(policy.param):
        return f"{short}-mixed"
    return "32-true"


def _lightning_module_in(ddp: DistributedDataParallel) -> nn.Module:
    """The module inside Lightning's DDP."""
    inner: nn.Module = ddp.module
    return inner


def _rebuild_ddp(old: DistributedDataParallel, module: LightningModule) -> nn.Module:
    """Lightning's DDP again, built by its strategy over the module ``wrap`` converted.

    Lightning wraps the module in DDP before the precision plugin sees the optimizers; that
    DDP's gradient buckets were laid out for the float32 parameters, and its autograd hooks
    sit on them. The old DDP is dropped (its reducer removes its hooks when it is freed) and
    the strategy builds a new one, with its own settings, over the converted parameters.
    """
    strategy = module.trainer.strategy
    setup = getattr(strategy, "_setup_model", None)
    if setup is None:  # pragma: no cover - a DDP made by a strategy without the method
        raise WrapError(
            f"MixprecPrecision cannot rebuild the DistributedDataParallel of "
            f"{type(strategy).__name__}; use strategy='ddp' or 'ddp_spawn'"
        )
    del old
    gc.collect()  # the old reducer's autograd hooks go with it, before the new DDP's come
    ddp = setup(module)
    strategy.model = ddp
    register = getattr(strategy, "_register_ddp_hooks", None)
    if callable(register):
        register()  # the strategy's communication hooks (CUDA only in Lightning)
    return ddp  # type: ignore[no-any-return]


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a ``LightningOptimizer``."""
    if isinstance(optimizer, LightningOptimizer):
        inner: torch.optim.Optimizer = optimizer.optimizer
        return inner
    opt: torch.optim.Optimizer = optimizer
    return opt


def _needs_closure(optimizer: Any) -> bool:
    """Whether the optimizer's own ``step`` requires a closure (LBFGS re-evaluates it)."""
    opt = _unwrap(optimizer)
    base = getattr(type(opt), "_mixprec_base", type(opt))
    param = inspect.signature(base.step).parameters.get("closure")
    return param is not None and param.default is inspect.Parameter.empty


class MixprecPrecision(Precision):
    """A Lightning precision plugin that trains under a mixprec policy.

    :param policy: a preset (``"O2-bf16"``, ``"O1"``, ``"torch-autocast"``...), a key-grammar
        string, a dict or a :class:`mixprec.Policy`; ``"auto"`` picks O1 with the fastest
        low-precision dtype of the model's device (resolved when the model is wrapped).
    :param log_state: log ``mixprec/loss_scale`` and ``mixprec/skipped_steps`` after each
        optimizer step.
    :param overrides: policy fields, as for ``mixprec.torch.wrap``.
    :raises PolicyError: a bad policy spec (at construction, before the Trainer runs).
    """

    precision: Any = "32-true"

    def __init__(self, policy: Any = "auto", *, log_state: bool = True, **overrides: Any) -> None:
        super().__init__()
        self.policy: Policy = get_policy(policy, **overrides)
        self.log_state = log_state
        self.precision = lightning_precision_name(self.policy)
        self._group: WrapGroup | None = None
        self._record: ModelRecord | None = None
        self._backwards = 0
        """Scaled backward passes so far (claimed by each optimizer at its next step)."""
        self._claimed: dict[int, int] = {}
        """id(optimizer) -> the value of :attr:`_backwards` when it last claimed them."""
        self._pending_state: dict[str, Any] | None = None

    # ------------------------------------------------------------------ set-up

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Lightning's Trainer hands its LightningModule here first (``connect`` wraps it
        next, with the optimizers); Fabric hands a bare model without its optimizer, which
        mixprec must convert together with it: refused, with the recipe that works."""
        if isinstance(module, LightningModule) and module._trainer is not None:
            return module
        raise WrapError(FABRIC_RECIPE)

    def connect(
        self, model: nn.Module, optimizers: list[torch.optim.Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], list[Any]]:
        """Wrap the module and the optimizers ``configure_optimizers`` built."""
        ddp = None
        if isinstance(model, DistributedDataParallel):
            ddp, model = model, _lightning_module_in(model)
        if not isinstance(model, LightningModule):
            raise WrapError(
                f"MixprecPrecision got the LightningModule already wrapped in "
                f"{type(model).__name__} by the strategy; mixprec converts the bare module, "
                "and supports Lightning's single-device strategies, its DDP strategies "
                f"(strategy='ddp', 'ddp_spawn') and FSDP2: {FSDP_RECIPE}"
            )
        self._refuse_closure_optimizers(optimizers)
        record = getattr(model, "_mixprec", None)
        if isinstance(record, ModelRecord):
            self._reuse(record, optimizers)
        else:
            self._wrap(model, optimizers)
            record = model._mixprec
            assert isinstance(record, ModelRecord)
        self._record = record
        self._group = record.group
        self.policy = record.policy
        self.precision = lightning_precision_name(record.policy)
        self._backwards = 0
        self._claimed = {}
        if self._pending_state is not None:
            pending, self._pending_state = self._pending_state, None
            self.load_state_dict(pending)
        if ddp is not None:
            return _rebuild_ddp(ddp, model), optimizers, lr_schedulers
        return model, optimizers, lr_schedulers

    def _wrap(self, model: LightningModule, optimizers: list[torch.optim.Optimizer]) -> None:
        """``wrap`` the module; under FSDP2 a refusal names the Lightning recipe too."""
        try:
            wrap(model, list(optimizers), policy=self.policy)
        except WrapError as err:
            if not is_fsdp_managed(model):
                raise
            raise WrapError(
                f"{err}. Under Lightning, shard in configure_model with "
                "self.trainer.precision_plugin.fully_shard(module, "
                "mesh=self.device_mesh['data_parallel']), which applies the plugin's policy"
            ) from err

    def fully_shard(
        self, module: nn.Module, *, blocks: Any = (), **fully_shard_kwargs: Any
    ) -> nn.Module:
        """Shard ``module`` with FSDP2 under the plugin's policy, from ``configure_model``.

        ``mixprec.torch.fully_shard_with_policy(module, policy, blocks=blocks,
        **fully_shard_kwargs)`` with this plugin's policy; ``"auto"`` is resolved first for
        the module's device (``wrap`` keeps that resolution). Pass the strategy's
        data-parallel mesh: ``mesh=self.device_mesh["data_parallel"]`` under Lightning's
        ``ModelParallelStrategy``. Returns ``module``, sharded in place.
        """
        if not self.policy.is_resolved:
            _, self.policy = resolve_policy([module], self.policy)
            self.precision = lightning_precision_name(self.policy)
        return fully_shard_with_policy(module, self.policy, blocks=blocks, **fully_shard_kwargs)

    def __repr__(self) -> str:
        return f"MixprecPrecision({str(self.policy)!r})"

    def _refuse_closure_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Refuse LBFGS-like optimizers under a policy their closure cannot run under."""
        needy = [type(o).__name__ for o in optimizers if _needs_closure(o)]
        if not needy or not self.policy.is_resolved:  # "auto": step(closure) checks it later
            return
        if not isinstance(self.policy.loss_scale, NoScale) or self.policy.master_strategy:
            raise WrapError(
                f"MixprecPrecision cannot drive {', '.join(needy)} under policy "
                f"{self.policy}: its step re-runs Lightning's closure, whose backward pass "
                "cannot be loss-scaled (or whose compensated masters exist only inside one "
                "update). Use a policy without loss scaling and with float32 masters "
                "(MixprecPrecision('O2-bf16'), 'O1-bf16', 'O0', or loss_scale=None)"
            )

    def _reuse(self, record: ModelRecord, optimizers: list[torch.optim.Optimizer]) -> None:
        """A module wrapped by an earlier ``fit`` (then ``validate``/``test``): keep its wrap."""
        if self.policy.is_resolved and self.policy != record.policy:
            raise WrapError(
                f"this LightningModule was already trained under policy {record.policy}, not "
                f"{self.policy}; build a fresh module (load the checkpoint into it) to change "
                "the policy"
            )
        stray = [type(o).__name__ for o in optimizers if not hasattr(o, "_mixprec")]
        if stray:
            raise WrapError(
                "this LightningModule was already wrapped by an earlier trainer.fit, and "
                f"configure_optimizers built new optimizers ({', '.join(stray)}) that cannot "
                "join that wrap; build a fresh module for another fit, and resume with "
                "trainer.fit(model, ckpt_path=...)"
            )

    # ------------------------------------------------------------------ forward

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Run a ``*_step`` inside the model's op-casting region (O1 and op rules)."""
        casting = self._record.casting.casting if self._record is not None else None
        with region(casting) if casting is not None else nullcontext():
            yield

    # ------------------------------------------------------------------ backward and step

    def pre_backward(self, tensor: torch.Tensor, module: LightningModule) -> torch.Tensor:  # type: ignore[override]
        """Run Lightning's ``on_before_backward`` hooks, then scale the loss (float32)."""
        tensor = super().pre_backward(tensor, module)
        group = self._wrapped_group()
        scaled = tensor if tensor.dtype == torch.float32 else tensor.to(torch.float32)
        if group.scaler.enabled:
            scaled = scaled * group.scaler.scale
        self._backwards += 1
        return scaled

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure, unscale, clip, then step (or skip) without a closure; an
        optimizer whose ``step`` requires the closure (LBFGS) gets it passed through."""
        if _needs_closure(optimizer):
            return self._closure_step(optimizer, model, closure, **kwargs)
        closure_result = closure()
        # automatic optimization: a training_step that returned None ran no backward pass
        skip = closure_result is None and model.automatic_optimization
        if not skip:
            self._unscale_once(optimizer)
        self._after_closure(model, optimizer)
        if skip:
            return closure_result
        _unwrap(optimizer).step(**kwargs)
        if self.log_state:
            self._log_state(model, optimizer)
        return closure_result

    def _closure_step(
        self,
        optimizer: Any,
        model: LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Step an optimizer that re-runs the closure (LBFGS) through ``step(closure)``.

        The wrapped step evaluates the closure once, then again on each line-search
        evaluation with the masters copied in. Every evaluation's backward pass is claimed
        here (the step counts it itself); the hooks and clipping follow the first one, on
        the float32 master gradients, as for the other optimizers.
        """
        opt = _unwrap(optimizer)
        evaluations = 0

        def evaluate() -> Any:
            nonlocal evaluations
            evaluations += 1
            result = closure()
            if evaluations == 1:
                self._after_closure(model, optimizer)  # clipping unscales through _unscale_once
            self._claimed[id(opt)] = self._backwards
            return result

        loss = opt.step(closure=evaluate, **kwargs)
        if self.log_state:
            self._log_state(model, optimizer)
        return loss

    def clip_gradients(
        self,
        optimizer: Any,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip the unscaled float32 master gradients (unscaling first if not yet done)."""
        if clip_val <= 0:
            return
        self._unscale_once(optimizer)
        super().clip_gradients(_unwrap(optimizer), clip_val, gradient_clip_algorithm)

    def main_params(self, optimizer: Any) -> Iterator[torch.Tensor]:  # type: ignore[override]
        """The tensors the optimizer updates: the float32 masters (or the params themselves)."""
        yield from master_params(_unwrap(optimizer))

    def _unscale_once(self, optimizer: Any) -> None:
        """Claim the backward passes since the optimizer's last step, then unscale (once)."""
        opt = _unwrap(optimizer)
        st = optimizer_state(opt, "MixprecPrecision")
        tracker = st.tracker
        if tracker.stage is Stage.UNSCALED:
            return
        if self._backwards > self._claimed.get(id(opt), 0):
            if tracker.stage is Stage.READY and tracker.backwards == 0:
                tracker.on_backward()
            self._claimed[id(opt)] = self._backwards
        elif tracker.backwards == 0 and st.iteration.round is None:
            raise StepOrderError(
                "the optimizer is stepping (or clipping) with no backward pass since its last "
                "step; call self.manual_backward(loss) before opt.step() in training_step"
            )
        unscale_(opt)

    def _log_state(self, model: LightningModule, optimizer: Any) -> None:
        snap = state(_unwrap(optimizer))
        model.log("mixprec/loss_scale", snap.loss_scale, on_step=True, on_epoch=False)
        model.log("mixprec/skipped_steps", float(snap.skipped_steps), on_step=True, on_epoch=False)

    def _wrapped_group(self) -> WrapGroup:
        if self._group is None:
            raise WrapError(
                "MixprecPrecision has not wrapped a model yet; pass it to the Trainer "
                "(lightning.Trainer(plugins=[MixprecPrecision(...)])) and let fit() set it up"
            )
        return self._group

    # ------------------------------------------------------------------ state

    def mixprec_state(self) -> MixprecState:
        """Loss scale, skip counters, resolved policy and events of the wrapped training."""
        group = self._wrapped_group()
        return group.scaler.snapshot(group.policy)

    def state_dict(self) -> dict[str, Any]:
        """The resolved policy and the loss-scaler state (saved in Lightning checkpoints)."""
        if self._group is None:
            return {}
        return {"policy": self._group.policy.to_dict(), "scaler": self._group.scaler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the loss-scaler state (kept until ``connect`` if nothing is wrapped yet)."""
        if not state_dict:
            return
        if "scaler" not in state_dict:
            raise CheckpointError(
                "the checkpoint's MixprecPrecision entry has no 'scaler'; save it with a "
                "Trainer that uses MixprecPrecision"
            )
        if self._group is None:
            self._pending_state = dict(state_dict)
            return
        scaler = self._group.scaler
        saved = state_dict.get("policy")
        saved_policy = None if saved is None else _saved_policy(saved)  # validate first
        LossScaler(scaler.state.fresh()).load_state_dict(state_dict["scaler"])
        if saved_policy is not None and saved_policy != self._group.policy:
            warnings.warn(
                f"the checkpoint was saved under policy {saved_policy} but this Trainer's "
                f"MixprecPrecision runs {self._group.policy}; training continues with the "
                f"current policy. Build the plugin with MixprecPrecision({str(saved_policy)!r}) "
                "to resume exactly",
                MixprecWarning,
                stacklevel=2,
            )
        scaler.load_state_dict(state_dict["scaler"])


def _saved_policy(data: Any) -> Policy:
    try:
        return Policy.from_dict(data)
    except (MixprecError, TypeError, ValueError, AttributeError, RecursionError) as err:
        raise CheckpointError(
            f"the checkpoint's MixprecPrecision entry holds a malformed policy ({err}); save "
            "it with a Trainer that uses MixprecPrecision"
        ) from err
