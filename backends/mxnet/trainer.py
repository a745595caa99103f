"""The Gluon Trainer: construction (policy, net conversion) and the user-facing API.

:class:`Trainer` is a ``gluon.Trainer`` (``isinstance`` holds) built the same way, plus a
``policy``. One iteration::

    with autograd.record():
        loss = loss_fn(net(x), y)
        with trainer.scale_loss(loss) as scaled:    # or right after the record block
            autograd.backward(scaled)
    trainer.step(batch_size)

The class is assembled from one module per job: this one builds the trainer, converts the
net and offers ``scale_loss``, the scaler's counters and the checkpoint methods;
:mod:`~.wrapping.masters` makes the float32 masters, casts the parameters and broadcasts the initial
weights; :mod:`.stepping` runs ``step`` (``allreduce_grads`` + ``update``: unscale, overflow
check, skip or update) and :mod:`~.step.checkpoint` saves and loads. The scale the state machine
returns is used by the very next ``scale_loss``. For clipping: ``allreduce_grads()``,
``unscale()``, clip ``trainer.master_grads()``, ``update(batch_size)``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import mxnet as mx
from mxnet import autograd, gluon, nd

from mixprec.errors import MixprecWarning, WrapError
from mixprec.kit import (
    BFLOAT16,
    FLOAT32,
    LossScaler,
    MasterWeights,
    Policy,
    ScalerCounters,
    StepGuard,
    StepTracker,
    check_adam_eps,
    check_seed,
    is_low_precision,
)

from .blocks import BlockTree, walk
from .compensated.compensation import Compensation
from .devices import device_key, resolve_policy
from .gluon_private import (
    clear_cached_graph,
    deferred_state,
    finish_deferred_init,
    is_deferred,
    restore_deferred_state,
)
from .step import checkpoint, optimizers, states  # noqa: F401 - optimizers registers "adamw"
from .step.accumulation import Accumulation, check_grad_req, install_zero_grad
from .step.running_stats import RunningStats
from .stepping import Stepping
from .wrapping.casting import convert_net, param_dtypes, param_dtypes_by_name
from .wrapping.checks import (
    check_dense,
    check_parameters,
    check_shaped,
    check_state,
    densify_embeddings,
    shape_refusal,
    sparse_embeddings,
    warn_params_only,
)
from .wrapping.export import patch_export
from .wrapping.islands import unconverted
from .wrapping.ownership import Snapshot, check_unclaimed, claim
from .wrapping.symbol_blocks import check_not_amp_converted

__all__ = ["Trainer"]


class Trainer(ScalerCounters, Stepping, gluon.Trainer):
    """A ``gluon.Trainer`` that trains under a mixprec policy.

    :param net_or_params: the net (a ``Block``, converted in place per the policy) or its
        parameters (a ``ParameterDict``, dict or list: only parameter casting and masters
        can be applied then, and a warning says what is left out).
    :param optimizer, optimizer_params, kvstore, compression_params: as for ``gluon.Trainer``.
    :param policy: a preset (``"O2-bf16"``), key spec, TOML path, dict or ``Policy``;
        ``"auto"`` picks bfloat16 on CPUs whose oneDNN has native bfloat16 GEMM kernels
        (AVX512-BF16), float32 on other CPUs, float16 on GPUs.
    :param update_on_kvstore: must not be True (the server could not skip a step).
    :param guard: a :class:`mixprec.StepGuard` (or a dict of its options): how often
        repeated skipped steps warn (``warn_after``, default 10 in a row). A step whose
        gradients are non-finite or whose squared norm overflows float32 is always skipped,
        and a skipped step puts the net's BatchNorm running statistics back.
    :param seed: seeds the stochastic rounding of ``master=stochastic`` (``O3-bf16-sr``);
        its random stream is saved by ``save_states``, so a resumed run draws the same numbers.
        A policy with ``state="bfloat16"`` is refused (``WrapError``): MXNet has no bfloat16
        optimizer kernels, so the optimizer state stays float32.
    :param overrides: policy role overrides, e.g. ``loss_scale="dynamic"``.
    """

    def __init__(
        self,
        net_or_params: Any,
        optimizer: Any,
        optimizer_params: dict[str, Any] | None = None,
        policy: Any = "auto",
        kvstore: Any = "device",
        compression_params: dict[str, Any] | None = None,
        update_on_kvstore: bool | None = None,
        *,
        guard: StepGuard | Mapping[str, Any] | None = None,
        seed: int = 0,
        **overrides: Any,
    ) -> None:
        step_guard = StepGuard.coerce(guard)
        self._seed = check_seed(seed)
        if update_on_kvstore:
            raise WrapError(
                "update_on_kvstore=True updates the weights inside the kvstore, where an "
                "overflowed step cannot be skipped and no float32 masters exist; leave "
                "update_on_kvstore unset (mixprec uses False)"
            )
        net = net_or_params if isinstance(net_or_params, gluon.Block) else None
        params = net.collect_params() if net is not None else net_or_params
        values = list(params.values()) if hasattr(params, "values") else list(params)
        check_parameters(values, type(net_or_params).__name__)
        # the construction plan: every later pass reads this one walk of the block tree
        tree = walk(net) if net is not None else None
        embeddings = sparse_embeddings(tree)
        check_dense([p for p in values if id(p) not in embeddings])
        contexts = values[0].list_ctx()
        self.policy: Policy = resolve_policy(policy, contexts, **overrides)
        """The resolved policy this trainer runs (saved with its states)."""
        check_state(self.policy)
        self.device = device_key(contexts[0])
        check_unclaimed(values)  # after the policy: a policy this device cannot run is named first
        for info in tree.blocks if tree is not None else ():
            check_not_amp_converted(info.block)
        self._tree: BlockTree | None = tree
        """The construction's one walk of the net (None without a net)."""
        snapshot = Snapshot(
            [info.block for info in tree.blocks] if tree is not None else [], values
        )
        try:
            self._build(
                net,
                params,
                values,
                optimizer,
                optimizer_params,
                kvstore,
                compression_params,
                step_guard,
            )
        except BaseException:
            snapshot.restore()  # a failed construction leaves the net as it was
            raise
        claim(values, self.policy.label)
        self._lint()

    def _build(
        self,
        net: gluon.Block | None,
        params: Any,
        values: list[gluon.Parameter],
        optimizer: Any,
        optimizer_params: dict[str, Any] | None,
        kvstore: Any,
        compression_params: dict[str, Any] | None,
        step_guard: StepGuard,
    ) -> None:
        tree = self._tree
        if tree is not None:
            densify_embeddings(tree)
        super().__init__(params, optimizer, optimizer_params, kvstore, compression_params, False)
        self.scaler = LossScaler(self.policy.loss_scale, guard=step_guard)
        """The loss-scale state and step/skip counters (shared state for one group)."""
        self._tracker = StepTracker()
        if tree is not None:
            self._plan = param_dtypes(tree, values, self.policy, self.device)
        else:
            self._plan = param_dtypes_by_name(params, self.policy)
        check_grad_req(self._plan, self.policy.label)
        if any(is_low_precision(dtype) for _, dtype in self._plan):
            install_zero_grad()
        self._accumulation = Accumulation()
        """``grad_req='add'`` on low-precision parameters: the float32 sums in the masters."""
        self.masters: MasterWeights[gluon.Parameter] | None = None
        """(model parameter, master parameter) pairs, once the parameters are initialised."""
        self._net = net
        self._reduced = False
        self._buffers: dict[int, list[nd.NDArray]] = {}
        self._transient = False
        self._compensation: Compensation | None = None
        """Under ``master=kahan|stochastic``: the strategy's buffers and its step passes."""
        self._running_stats: RunningStats | None = None
        if net is not None and tree is not None:
            # before convert_net: its input casts and deferred set-up then run first
            stats = RunningStats(net, tree.post_order)
            self._running_stats = stats if stats.params else None
            convert_net(
                net, tree, values, self.policy, self.device, before_forward=self._before_forward
            )
            checkpoint.patch_net(net, self)
            patch_export(net, self)
        else:
            check_shaped(self._plan)
            warn_params_only(self.policy)
        if not any(is_deferred(p) for p in self._params):
            self._prepare()

    # ------------------------------------------------------------------ set-up

    def _before_forward(self, args: Sequence[Any]) -> None:
        if self.masters is None:
            self._first_forward(args)
        if autograd.is_recording():
            self._accumulation.before_forward()

    def _first_forward(self, args: Sequence[Any]) -> None:
        deferred = [p for p in self._params if is_deferred(p)]
        net = self._net
        before = deferred_state(deferred)
        try:
            if deferred and isinstance(net, gluon.HybridBlock):
                net.infer_shape(*args)
            elif deferred and net is not None:
                # a plain Block has no infer_shape: one forward pass (the class's, not the
                # instance's wrapped one; unconverted, in float32 as the fresh weights are;
                # no recording, so no statistics change) gives the shapes
                with autograd.pause(train_mode=False), unconverted():
                    type(net).forward(net, *args)
            for param in deferred:
                if is_deferred(param):
                    finish_deferred_init(param)
        except (mx.MXNetError, AssertionError, ValueError) as err:
            restore_deferred_state(before)  # the net waits for a first input that fits
            raise WrapError(shape_refusal(net, args, err)) from err
        if deferred and self._tree is not None:
            # the shape inference traced the graphs before the weights had shapes: trace
            # again, so that the graph is the one a net with loaded shapes gets (the casts
            # around BatchNorm read the convolution's channels)
            for info in self._tree.blocks:
                clear_cached_graph(info.block)
        # the first forward pass may run inside autograd.record(), which refuses the writes
        # that set up masters, casts and the kvstore broadcast (none of them is part of the
        # graph): O3-bf16's float32 update copies used to fail there
        with autograd.pause():
            self._prepare()

    def _lint(self) -> None:
        eps = getattr(self._optimizer, "epsilon", None)
        if eps is None:
            return
        # MXNet's optimizer kernels reject bfloat16 weights, so without masters a bfloat16
        # net is updated through float32 copies and Adam's state is float32 either way
        param = self.policy.param
        if self.policy.master_strategy is not None:  # updated as float32 working values
            state = FLOAT32
        else:
            state = self.policy.master or (FLOAT32 if param == BFLOAT16 else param)
        message = check_adam_eps(type(self._optimizer).__name__, float(eps), state)
        if message:
            warnings.warn(message, MixprecWarning, stacklevel=3)

    # ------------------------------------------------------------------ the loss scale

    @contextlib.contextmanager
    def scale_loss(self, loss: Any) -> Iterator[Any]:
        """Yield ``loss`` (or a list of losses) times the current loss scale, for backward.

        Works inside ``autograd.record()`` or right after it.
        """
        self._tracker.on_backward()
        if not self.scaler.enabled:
            yield loss
        else:
            scale = self.scaler.scale
            with contextlib.ExitStack() as stack:
                if not autograd.is_recording():
                    stack.enter_context(autograd.record())
                if isinstance(loss, (list, tuple)):
                    scaled = [part * scale for part in loss]
                else:
                    scaled = loss * scale
            yield scaled
        if self.masters is not None:  # the backward ran: grad_req='add' sums in float32
            self._accumulation.after_backward()

    # ------------------------------------------------------------------ masters

    def master_params(self) -> list[gluon.Parameter]:
        """What the optimizer updates, one per parameter: the float32 master where the
        model parameter is low precision, else the parameter itself."""
        return self._ensure_prepared().masters()

    def master_grads(self, ctx: mx.Context | None = None) -> list[nd.NDArray]:
        """The gradients the update reads on ``ctx`` (default: the first context), after
        ``allreduce_grads()``: clip these."""
        ctx = ctx or self._contexts[0]
        return [master.grad(ctx) for _, master in self._trainable_pairs()]

    # ------------------------------------------------------------------ checkpoints

    def save_states(self, fname: str) -> None:
        """Save the optimizer state, the loss-scaler state and the policy."""
        self._ensure_prepared()
        states.save_states(self, fname)

    def load_states(self, fname: str) -> None:
        """Load what :meth:`save_states` wrote (the policy must match this trainer's)."""
        self._ensure_prepared()
        states.load_states(self, fname)
        self._tracker.reset()
        self._reduced = False

    def save_parameters(self, fname: str, deduplicate: bool = False) -> None:
        """Save the parameters as float32 master values (``net.save_parameters`` does this
        too when the Trainer was given the net)."""
        checkpoint.save_parameters(self, fname, deduplicate=deduplicate)

    def load_parameters(self, fname: str, **kwargs: Any) -> None:
        """Load float32 values into the masters, then cast them into the model."""
        checkpoint.load_parameters(self, fname, **kwargs)
