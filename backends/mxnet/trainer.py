"""The Gluon Trainer: one class, its construction and every method the user calls.

:class:`Trainer` is a ``gluon.Trainer`` (``isinstance`` holds) built the same way, plus a
``policy``. One iteration::

    with autograd.record():
        loss = loss_fn(net(x), y)
        with trainer.scale_loss(loss) as scaled:    # or right after the record block
            autograd.backward(scaled)
    trainer.step(batch_size)

Construction walks the net once (:func:`~.blocks.walk`), refuses what it cannot train
(:mod:`~.wrapping.checks`), converts the net (:mod:`~.wrapping.casting`) and makes the float32
masters (:mod:`~.wrapping.masters`); mixprec's part of the trainer is one data-only
:class:`~.step.trainer_state.TrainerState` (``trainer._mixprec``), which the step's functions
(:mod:`~.step.protocol`: scale, reduce, unscale, check, update or skip) and the checkpoints
(:mod:`~.step.checkpoint`, :mod:`~.step.states`) work on; the methods here call them in
order. The scale the state machine returns is used by the very next ``scale_loss``. For
clipping: ``allreduce_grads()``, ``unscale()``, clip ``trainer.master_grads()``,
``update(batch_size)``.
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
    check_adam_eps,
    check_seed,
    is_low_precision,
    parse_state_format,
)

from .blocks import walk
from .devices import device_key, resolve_policy
from .dtypes import dtype_name
from .gluon_private import (
    clear_cached_graph,
    deferred_state,
    finish_deferred_init,
    is_deferred,
    restore_deferred_state,
)
from .lowbit.state import LowBitState, layout_of
from .step import checkpoint, optimizers, protocol, states  # noqa: F401 - optimizers registers "adamw"
from .step.accumulation import check_grad_req, install_zero_grad
from .step.running_stats import RunningStats
from .step.trainer_state import TrainerState, param_names
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
from .wrapping.masters import ensure_prepared, init_params, prepare, sync_transient_masters
from .wrapping.ownership import Snapshot, check_unclaimed, claim
from .wrapping.symbol_blocks import check_not_amp_converted

__all__ = ["Trainer"]


class Trainer(ScalerCounters, gluon.Trainer):
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
        Under ``state="bfloat16"`` (``"O3-bf16-kahan,state=bfloat16"``, ``"O3-bf16-sr,..."``)
        the optimizer state of the compensated parameters is held in bfloat16 between steps,
        widened to float32 for MXNet's update and rounded back stochastically from the same
        stream (any optimizer: every float32 state array of the parameter's shape). A
        low-bit ``state`` (``"O2-bf16,state=int8"``; ``int4``, ``fp8``) keeps the momentum or
        Adam's moments quantized between steps (``sgd``, ``nag``, ``adam``, ``adamw``,
        ``lamb``; any other optimizer is refused with ``WrapError``), decoded into float32
        for each update.
    :param overrides: policy role overrides, e.g. ``loss_scale="dynamic"``.

    Example::

        from mxnet import autograd, gluon, nd
        import mixprec.mxnet as mpx

        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Dense(16, activation="relu"), gluon.nn.Dense(2))
        net.initialize()
        trainer = mpx.Trainer(net, "adam", {"learning_rate": 1e-3}, policy="O2-bf16")
        loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
        x, y = nd.random.normal(shape=(4, 8)), nd.array([0, 1, 1, 0])
        with autograd.record():
            loss = loss_fn(net(x), y)
            with trainer.scale_loss(loss) as scaled:
                autograd.backward(scaled)
        trainer.step(4)
        print(trainer.skipped_steps)   # 0
    """

    _mixprec: TrainerState

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
        seed = check_seed(seed)
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
        resolved = resolve_policy(policy, contexts, **overrides)
        check_state(resolved)
        device = device_key(contexts[0])
        check_unclaimed(values)  # after the policy: a policy this device cannot run is named first
        for info in tree.blocks if tree is not None else ():
            check_not_amp_converted(info.block)
        scaler = LossScaler(resolved.loss_scale, guard=step_guard)
        st = TrainerState(resolved, device, scaler, seed, net, tree)
        snapshot = Snapshot(
            [info.block for info in tree.blocks] if tree is not None else [], values
        )
        try:
            self._build(
                st, params, values, optimizer, optimizer_params, kvstore, compression_params
            )
        except BaseException:
            snapshot.restore()  # a failed construction leaves the net as it was
            raise
        claim(values, self.policy.label)
        self._lint()

    def _build(
        self,
        st: TrainerState,
        params: Any,
        values: list[gluon.Parameter],
        optimizer: Any,
        optimizer_params: dict[str, Any] | None,
        kvstore: Any,
        compression_params: dict[str, Any] | None,
    ) -> None:
        net, tree, policy, device = st.net, st.tree, st.policy, st.device
        if tree is not None:
            densify_embeddings(tree)
        super().__init__(params, optimizer, optimizer_params, kvstore, compression_params, False)
        st.params = self._params  # gluon.Trainer's list, in its index order
        self._mixprec = st
        lowbit = parse_state_format(policy.state) if policy.state is not None else None
        if lowbit is not None:  # the optimizer is made: refuse one whose state is unknown
            layout = layout_of(self._optimizer, lowbit)
            st.lowbit = LowBitState(lowbit, layout, param_names(st))
        if tree is not None:
            st.plan = param_dtypes(tree, values, policy, device)
        else:
            st.plan = param_dtypes_by_name(params, policy)
        check_grad_req(st.plan, policy.label)
        if any(is_low_precision(dtype) for _, dtype in st.plan):
            install_zero_grad()
        if net is not None and tree is not None:
            # before convert_net: its input casts and deferred set-up then run first
            stats = RunningStats(net, tree.post_order)
            st.running_stats = stats if stats.params else None
            convert_net(net, tree, values, policy, device, before_forward=self._before_forward)
            checkpoint.patch_net(net, self)
            patch_export(net, self)
        else:
            check_shaped(st.plan)
            warn_params_only(policy)
        if not any(is_deferred(p) for p in self._params):
            prepare(st, self)

    # ------------------------------------------------------------------ what it holds

    @property
    def policy(self) -> Policy:
        """The resolved policy this trainer runs (saved with its states)."""
        return self._mixprec.policy

    @property
    def device(self) -> str:
        """The device key of the parameters' first context (``"cpu"``, ``"gpu"``)."""
        return self._mixprec.device

    @property  # ScalerCounters reads it; read-only here, the state holds the one scaler
    def scaler(self) -> LossScaler:  # type: ignore[override]
        """The loss-scale state and step/skip counters (shared state for one group)."""
        return self._mixprec.scaler

    @property
    def masters(self) -> MasterWeights[gluon.Parameter] | None:
        """(model parameter, master parameter) pairs, once the parameters are initialised."""
        return self._mixprec.masters

    # ------------------------------------------------------------------ deferred shapes

    def _before_forward(self, args: Sequence[Any]) -> None:
        st = self._mixprec
        if st.masters is None:
            self._first_forward(args)
        if autograd.is_recording():
            st.accumulation.before_forward()

    def _first_forward(self, args: Sequence[Any]) -> None:
        st = self._mixprec
        deferred = [p for p in self._params if is_deferred(p)]
        net = st.net
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
        if deferred and st.tree is not None:
            # the shape inference traced the graphs before the weights had shapes: trace
            # again, so that the graph is the one a net with loaded shapes gets (the casts
            # around BatchNorm read the convolution's channels)
            for info in st.tree.blocks:
                clear_cached_graph(info.block)
        # the first forward pass may run inside autograd.record(), which refuses the writes
        # that set up masters, casts and the kvstore broadcast (none of them is part of the
        # graph): O3-bf16's float32 update copies used to fail there
        with autograd.pause():
            prepare(st, self)

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

    # ------------------------------------------------------------------ the step

    @contextlib.contextmanager
    def scale_loss(self, loss: Any) -> Iterator[Any]:
        """Yield ``loss`` (or a list of losses) times the current loss scale, for backward.

        Works inside ``autograd.record()`` or right after it.
        """
        with protocol.scale_loss(self._mixprec, loss) as scaled:
            yield scaled

    def allreduce_grads(self) -> None:
        """Cast the model gradients into the master gradients and sum them over contexts and
        workers (once per iteration; ``update`` and ``step`` call it when you did not)."""
        st = self._mixprec
        ensure_prepared(st, self)
        if not st.reduced:
            st.accumulation.check(st.params, st.policy.label)
            protocol.reduce_grads(st, self)
            # param.grad() holds the reduced gradient, as under gluon.Trainer: an edit of it
            # before update() is checked and applied (accumulation.GradEdits)
            st.accumulation.edits.publish(protocol.trainable_pairs(st))

    def unscale(self) -> None:
        """Divide the master gradients by the loss scale now (before clipping them).

        :raises StepOrderError: no scaled backward ran, or unscale was already called.
        """
        st = self._mixprec
        st.tracker.on_unscale()
        self.allreduce_grads()
        st.accumulation.edits.take()
        protocol.unscale(st)
        # param.grad() shows the unscaled gradient, as the masters' do, and edits go on
        st.accumulation.edits.publish(protocol.trainable_pairs(st))

    def step(self, batch_size: int, ignore_stale_grad: bool = False) -> None:
        """Reduce, unscale, check, and update or skip; then update the loss scale."""
        self.update(batch_size, ignore_stale_grad)

    def update(self, batch_size: int, ignore_stale_grad: bool = False) -> None:
        """Check for overflow and update (or skip) after ``allreduce_grads`` (and ``unscale``)."""
        protocol.check_batch_size(batch_size)
        st = self._mixprec
        ensure_prepared(st, self)
        if st.reduced:  # edits of param.grad() since allreduce_grads(): into the masters'
            st.accumulation.edits.take()  # gradients (weights and state move only below)
        protocol.update(st, self, batch_size, ignore_stale_grad)

    # ------------------------------------------------------------------ masters

    def master_params(self) -> list[gluon.Parameter]:
        """What the optimizer updates, one per parameter: the float32 master where the
        model parameter is low precision, else the parameter itself."""
        return ensure_prepared(self._mixprec, self).masters()

    def master_grads(self, ctx: mx.Context | None = None) -> list[nd.NDArray]:
        """The gradients the update reads on ``ctx`` (default: the first context), after
        ``allreduce_grads()``: clip these."""
        ctx = ctx or self._contexts[0]
        ensure_prepared(self._mixprec, self)
        return [master.grad(ctx) for _, master in protocol.trainable_pairs(self._mixprec)]

    def reduce_dtype(self, param: gluon.Parameter) -> str:
        """The dtype ``param``'s gradient crosses the kvstore in."""
        masters = ensure_prepared(self._mixprec, self)
        return dtype_name(protocol.comm(self._mixprec, param, masters.master_for(param))[0].dtype)

    def sync_transient_masters(self) -> None:
        """Reset float32 update copies to the low-precision weights (policies without
        masters: the weights keep only their own precision between steps; under kahan the
        copies hold weight + compensation)."""
        sync_transient_masters(self._mixprec)

    def _init_params(self) -> None:
        # gluon.Trainer's kvstore initialisation, for the masters (wrapping/masters.py)
        init_params(self._mixprec, self)

    # ------------------------------------------------------------------ checkpoints

    def save_states(self, fname: str) -> None:
        """Save the optimizer state, the loss-scaler state and the policy."""
        ensure_prepared(self._mixprec, self)
        states.save_states(self, fname)

    def load_states(self, fname: str) -> None:
        """Load what :meth:`save_states` wrote (the policy must match this trainer's)."""
        st = self._mixprec
        ensure_prepared(st, self)
        states.load_states(self, fname)
        st.tracker.reset()
        st.reduced = False

    def save_parameters(self, fname: str, deduplicate: bool = False) -> None:
        """Save the parameters as float32 master values (``net.save_parameters`` does this
        too when the Trainer was given the net)."""
        checkpoint.save_parameters(self, fname, deduplicate=deduplicate)

    def load_parameters(self, fname: str, **kwargs: Any) -> None:
        """Load float32 values into the masters, then cast them into the model."""
        checkpoint.load_parameters(self, fname, **kwargs)
