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
:mod:`.masters` makes the float32 masters, casts the parameters and broadcasts the initial
weights; :mod:`.stepping` runs ``step`` (``allreduce_grads`` + ``update``: unscale, overflow
check, skip or update) and :mod:`.checkpoint` saves and loads. The scale the state machine
returns is used by the very next ``scale_loss``. For clipping: ``allreduce_grads()``,
``unscale()``, clip ``trainer.master_grads()``, ``update(batch_size)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import mxnet as mx
from mxnet import autograd, gluon, nd

from mixprec.compensated import check_seed
from mixprec.dtypes import BFLOAT16, FLOAT32, is_low_precision
from mixprec.errors import MixprecWarning, WrapError
from mixprec.guard import StepGuard
from mixprec.lint import check_adam_eps
from mixprec.masters import MasterWeights
from mixprec.policy import Policy
from mixprec.scaler import LossScaler, ScalerCounters
from mixprec.step import StepTracker

from . import checkpoint, optimizers, states  # noqa: F401 - optimizers registers "adamw"
from .accumulation import check_grad_req, install_zero_grad
from .casting import convert_net, param_dtypes
from .compensation import Compensation
from .devices import device_key, resolve_policy
from .dtypes import dtype_name
from .export import patch_export
from .gluon_private import (
    clear_cached_graph,
    dense_embedding_grad,
    finish_deferred_init,
    is_deferred,
    is_sparse,
)
from .graph import blocks_of
from .ops import island_natives
from .ownership import Snapshot, check_unclaimed, claim
from .running_stats import RunningStats
from .stepping import Stepping
from .symbol_blocks import check_not_amp_converted

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
        _check_parameters(values, type(net_or_params).__name__)
        sparse_embeddings = _sparse_embeddings(net)
        _check_dense([p for p in values if id(p) not in sparse_embeddings])
        contexts = values[0].list_ctx()
        self.policy: Policy = resolve_policy(policy, contexts, **overrides)
        """The resolved policy this trainer runs (saved with its states)."""
        _check_state(self.policy)
        self.device = device_key(contexts[0])
        check_unclaimed(values)  # after the policy: a policy this device cannot run is named first
        for info in blocks_of(net) if net is not None else ():
            check_not_amp_converted(info.block)
        snapshot = Snapshot(net, values)
        try:
            self._build(
                net, params, optimizer, optimizer_params, kvstore, compression_params, step_guard
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
        optimizer: Any,
        optimizer_params: dict[str, Any] | None,
        kvstore: Any,
        compression_params: dict[str, Any] | None,
        step_guard: StepGuard,
    ) -> None:
        if net is not None:
            _densify_embeddings(net)
        super().__init__(params, optimizer, optimizer_params, kvstore, compression_params, False)
        self.scaler = LossScaler(self.policy.loss_scale, guard=step_guard)
        """The loss-scale state and step/skip counters (shared state for one group)."""
        self._tracker = StepTracker()
        self._plan = param_dtypes(net if net is not None else params, self.policy, self.device)
        check_grad_req(self._plan, self.policy.label)
        if any(dtype == BFLOAT16 for _, dtype in self._plan):
            install_zero_grad()
        self.masters: MasterWeights[gluon.Parameter] | None = None
        """(model parameter, master parameter) pairs, once the parameters are initialised."""
        self._net = net
        self._reduced = False
        self._buffers: dict[int, list[nd.NDArray]] = {}
        self._transient = False
        self._compensation: Compensation | None = None
        """Under ``master=kahan|stochastic``: the strategy's buffers and its step passes."""
        self._running_stats: RunningStats | None = None
        if net is not None:
            # before convert_net: its input casts and deferred set-up then run first
            stats = RunningStats(net)
            self._running_stats = stats if stats.params else None
            convert_net(net, self.policy, self.device, before_forward=self._before_first_forward)
            checkpoint.patch_net(net, self)
            patch_export(net, self)
        else:
            _warn_params_only(self.policy)
        if not any(is_deferred(p) for p in self._params):
            self._prepare()
        elif net is None or not isinstance(net, gluon.HybridBlock):
            if any(dtype != dtype_name(p.dtype) for p, dtype in self._plan):
                raise WrapError(
                    "some parameters have no shape yet (deferred initialisation); mixprec "
                    "must cast them before the first forward pass. Give the layers their input "
                    "sizes (in_units=, in_channels=) or run one forward pass before building "
                    "the Trainer"
                )

    # ------------------------------------------------------------------ set-up

    def _before_first_forward(self, args: Sequence[Any]) -> None:
        if self.masters is not None:
            return
        deferred = [p for p in self._params if is_deferred(p)]
        net = self._net
        if deferred and isinstance(net, gluon.HybridBlock):
            net.infer_shape(*args)
        elif deferred and net is not None:
            # a plain Block has no infer_shape: one forward pass (the class's, not the
            # instance's wrapped one; no recording, so no statistics change) gives the shapes
            with autograd.pause(train_mode=False):
                type(net).forward(net, *args)
        for param in deferred:
            if is_deferred(param):
                finish_deferred_init(param)
        if deferred and net is not None:
            # the shape inference traced the graphs before the weights had shapes: trace
            # again, so that the graph is the one a net with loaded shapes gets (the casts
            # around BatchNorm read the convolution's channels)
            for info in blocks_of(net):
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
            return
        scale = self.scaler.scale
        with contextlib.ExitStack() as stack:
            if not autograd.is_recording():
                stack.enter_context(autograd.record())
            if isinstance(loss, (list, tuple)):
                scaled = [part * scale for part in loss]
            else:
                scaled = loss * scale
        yield scaled

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


def _check_state(policy: Policy) -> None:
    """Refuse ``state=bfloat16``: MXNet has no bfloat16 optimizer kernels and the Trainer
    keeps float32 working copies between steps anyway, so it would save nothing here."""
    if policy.state is not None:
        raise WrapError(
            f"policy {policy.label} keeps the optimizer state in {policy.state} between steps "
            "(state=bfloat16), which the Gluon Trainer does not support: MXNet's optimizers "
            "have no bfloat16 kernels and keep their state beside the float32 working "
            f"copies the Trainer holds between steps. Drop the item (policy="
            f"'{_without_state(policy)!s}') or use the torch backend for bfloat16 state"
        )


def _without_state(policy: Policy) -> Policy:
    return dataclasses.replace(policy, state=None, name=None)


def _check_parameters(values: Sequence[Any], given: str) -> None:
    if not values:
        raise WrapError(
            f"Trainer got no parameters (the {given} it was given has none to train); pass a "
            "net with layers (Trainer(net, ...), add layers before creating it) or its "
            "collect_params()"
        )
    wrong = [type(v).__name__ for v in values if not isinstance(v, gluon.Parameter)]
    if wrong:
        raise WrapError(
            f"Trainer got {wrong[0]} objects where gluon.Parameter objects belong (arrays hold "
            "values, not the parameters an optimizer updates); pass the net itself "
            "(Trainer(net, ...)) or net.collect_params()"
        )


def _check_dense(params: Sequence[gluon.Parameter]) -> None:
    sparse = [p.name for p in params if is_sparse(p)]
    if sparse:
        raise WrapError(
            f"sparse parameters or gradients ({', '.join(sparse[:3])}) need "
            "update_on_kvstore=True in Gluon, which mixprec cannot use; use dense storage"
        )


def _sparse_embeddings(net: gluon.Block | None) -> set[int]:
    """ids of the weights of the net's ``Embedding(sparse_grad=True)`` layers."""
    if net is None:
        return set()
    found = set()
    for info in blocks_of(net):
        block = info.block
        if isinstance(block, gluon.nn.Embedding) and is_sparse(block.weight):
            found.add(id(block.weight))
    return found


def _densify_embeddings(net: gluon.Block) -> None:
    switched = [
        info.path or type(info.block).__name__
        for info in blocks_of(net)
        if isinstance(info.block, gluon.nn.Embedding) and dense_embedding_grad(info.block)
    ]
    if switched:
        warnings.warn(
            f"Embedding(sparse_grad=True) at {', '.join(switched)}: mixprec trains it with dense "
            "gradients (the same updates, more memory), because Gluon's sparse gradients need "
            "update_on_kvstore=True, where an overflowed step cannot be skipped. Pass "
            "sparse_grad=False to silence this",
            MixprecWarning,
            stacklevel=4,
        )


def _warn_params_only(policy: Policy) -> None:
    left_out = []
    if policy.casts_ops:
        left_out.append("op casting (O1 casts ops inside the hybridized net)")
    if is_low_precision(policy.param):
        left_out.append(
            f"casting the net's inputs to {policy.compute} and outputs to {policy.output}, and "
            "class-based module rules such as BatchNorm's"
        )
    islands = sorted(island_natives(policy.compute, "cpu")) if policy.compute == BFLOAT16 else []
    if islands:
        left_out.append(
            f"float32 islands for {', '.join(islands)} (no bfloat16 kernel on this CPU: cast "
            "around them yourself)"
        )
    if left_out:
        warnings.warn(
            f"Trainer got parameters, not the net, so policy {policy.label} cannot apply "
            f"{' or '.join(left_out)}. Pass the net itself: Trainer(net, ...)",
            MixprecWarning,
            stacklevel=3,
        )
