"""The Gluon Trainer: one mixed-precision step (unscale, overflow check, skip or update).

:class:`Trainer` is a ``gluon.Trainer`` (``isinstance`` holds) built the same way, plus a
``policy``. One iteration::

    with autograd.record():
        loss = loss_fn(net(x), y)
        with trainer.scale_loss(loss) as scaled:    # or right after the record block
            autograd.backward(scaled)
    trainer.step(batch_size)

``step`` = ``allreduce_grads`` (model gradients cast into the float32 master gradients and
summed over contexts and workers in the policy's ``reduce`` dtype) + ``update`` (overflow
check on every context (``all_finite``), combined across workers; the loss-scale
state machine; then either the optimizer on the masters with ``1/scale`` folded into
``rescale_grad`` and the masters cast back into the model, or a skip that leaves weights and
optimizer state untouched). The scale the state machine returns is used by the very next
``scale_loss``. For clipping: ``allreduce_grads()``, ``unscale()``, clip
``trainer.master_grads()``, ``update(batch_size)``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import mxnet as mx
from mxnet import autograd, gluon, nd

from mixprec.dtypes import BFLOAT16, FLOAT32, is_low_precision
from mixprec.errors import MixprecWarning, StepOrderError, WrapError
from mixprec.events import EventLog
from mixprec.lint import check_adam_eps, check_scaler_without_masters
from mixprec.masters import MasterWeights
from mixprec.policy import Policy
from mixprec.scaler import LossScaler
from mixprec.step import Stage, StepTracker
from mixprec_mxnet import checkpoint, distributed
from mixprec_mxnet.casting import cast_param, convert_net, param_dtypes
from mixprec_mxnet.devices import device_key, resolve_policy
from mixprec_mxnet.dtypes import cast, dtype_name, mx_dtype

__all__ = ["Trainer"]

_BF16 = mx_dtype(BFLOAT16)


class Trainer(gluon.Trainer):
    """A ``gluon.Trainer`` that trains under a mixprec policy.

    :param net_or_params: the net (a ``Block``, converted in place per the policy) or its
        parameters (a ``ParameterDict``, dict or list: only parameter casting and masters
        can be applied then, and a warning says what is left out).
    :param optimizer, optimizer_params, kvstore, compression_params: as for ``gluon.Trainer``.
    :param policy: a preset (``"O2-bf16"``), key spec, TOML path, dict or ``Policy``;
        ``"auto"`` picks bfloat16 on CPUs with oneDNN, float16 on GPUs.
    :param update_on_kvstore: must not be True (the server could not skip a step).
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
        **overrides: Any,
    ) -> None:
        if update_on_kvstore:
            raise WrapError(
                "update_on_kvstore=True updates the weights inside the kvstore, where an "
                "overflowed step cannot be skipped and no float32 masters exist; leave "
                "update_on_kvstore unset (mixprec uses False)"
            )
        net = net_or_params if isinstance(net_or_params, gluon.Block) else None
        params = net.collect_params() if net is not None else net_or_params
        values = list(params.values()) if hasattr(params, "values") else list(params)
        _check_dense(values)
        contexts = values[0].list_ctx()
        self.policy: Policy = resolve_policy(policy, contexts, **overrides)
        """The resolved policy this trainer runs (saved with its states)."""
        self.device = device_key(contexts[0])
        super().__init__(params, optimizer, optimizer_params, kvstore, compression_params, False)
        self.scaler = LossScaler(self.policy.loss_scale)
        """The loss-scale state and step/skip counters (shared state for one group)."""
        self._tracker = StepTracker()
        self._plan = param_dtypes(net if net is not None else params, self.policy, self.device)
        self.masters: MasterWeights[gluon.Parameter] | None = None
        """(model parameter, master parameter) pairs, once the parameters are initialised."""
        self._net = net
        self._reduced = False
        self._buffers: dict[int, list[nd.NDArray]] = {}
        self._transient = False
        if net is not None:
            convert_net(net, self.policy, self.device, before_forward=self._before_first_forward)
            checkpoint.patch_net(net, self)
        else:
            _warn_params_only(self.policy)
        if not any(p._deferred_init for p in self._params):
            self._prepare()
        elif net is None or not isinstance(net, gluon.HybridBlock):
            if any(dtype != dtype_name(p.dtype) for p, dtype in self._plan):
                raise WrapError(
                    "some parameters have no shape yet (deferred initialisation); mixprec "
                    "must cast them before the first forward pass. Give the layers their input "
                    "sizes (in_units=, in_channels=) or run one forward pass before building "
                    "the Trainer"
                )
        self._lint()

    # ------------------------------------------------------------------ set-up

    def _before_first_forward(self, args: Sequence[Any]) -> None:
        if self.masters is not None:
            return
        deferred = [p for p in self._params if p._deferred_init]
        if deferred and self._net is not None:
            self._net.infer_shape(*args)
            for param in deferred:
                param._finish_deferred_init()
        self._prepare()

    def _prepare(self) -> None:
        """Make the masters, cast the parameters, create the kvstore and sync the weights."""
        planned = {id(p): dtype for p, dtype in self._plan}
        # MXNet has no bfloat16 optimizer kernels: without masters in the policy (O3), the
        # update runs on float32 copies that are reset to the rounded weights after each step
        self._transient = self.policy.master is None and BFLOAT16 in planned.values()
        self.masters = MasterWeights(
            self._params,
            master_dtype=FLOAT32 if self._transient else self.policy.master,
            dtype_of=lambda p: planned.get(id(p), dtype_name(p.dtype)),
            make_master=self._make_master,
        )
        for param, dtype in self._plan:
            cast_param(param, dtype)
        self.sync_transient_masters()
        lowp = [p.name for p, dtype in self._plan if is_low_precision(dtype)]
        check_scaler_without_masters(self.policy, [] if self.policy.master else lowp)
        distributed.init_kvstore_eagerly(self)

    def _make_master(self, param: gluon.Parameter) -> gluon.Parameter:
        dtype = self.policy.master or FLOAT32
        master = gluon.Parameter(param.name, shape=param.shape, dtype=mx_dtype(dtype))
        master._init_impl(cast(param.list_data()[0], dtype), param.list_ctx())
        return master

    def sync_transient_masters(self) -> None:
        """Reset float32 update copies to the low-precision weights (policies without
        masters: the weights keep only their own precision between steps)."""
        if self.masters is not None and self._transient:
            for param, master in self.masters.copied_pairs():
                for data, weight in zip(param.list_data(), master.list_data(), strict=True):
                    cast(data, dtype_name(weight.dtype), out=weight)

    def _ensure_prepared(self) -> MasterWeights[gluon.Parameter]:
        if self.masters is None:
            if any(p._deferred_init for p in self._params):
                raise StepOrderError(
                    "the parameters are not initialised yet: run a forward pass (net(x)) "
                    "before stepping, saving or loading the trainer"
                )
            self._prepare()
        assert self.masters is not None
        return self.masters

    def _init_params(self) -> None:
        # Gluon broadcasts the model weights; mixprec broadcasts what the optimizer updates
        # (the masters), initialising each key in the dtype its gradients are reduced in.
        if self.masters is None:
            return
        pending = []
        for param in self._params_to_init:
            if param._deferred_init:
                pending.append(param)
            elif self._kvstore is not None:
                self._broadcast(param)
        self._params_to_init = pending

    def _broadcast(self, param: gluon.Parameter) -> None:
        idx = self._param2idx[param.name]
        master = self.masters.master_for(param)  # type: ignore[union-attr]
        weights = master.list_data()
        comm = self._comm(param, master) if param.grad_req != "null" else weights
        if comm[0].dtype == weights[0].dtype:
            self._kvstore.broadcast(idx, weights[0], out=weights)
        else:
            self._kvstore.init(idx, comm[0])
            for weight in weights[1:]:
                weights[0].copyto(weight)
        if master is not param:
            for data, value in zip(param.list_data(), weights, strict=True):
                cast(value, dtype_name(data.dtype), out=data)

    def _lint(self) -> None:
        eps = getattr(self._optimizer, "epsilon", None)
        if eps is None:
            return
        state = self.policy.master or self.policy.param
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

    @property
    def loss_scale(self) -> float:
        """The scale the next ``scale_loss`` multiplies by."""
        return self.scaler.scale

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far because a gradient was inf or NaN."""
        return self.scaler.skipped_steps

    @property
    def last_step_skipped(self) -> bool:
        """Whether the latest step was skipped."""
        return self.scaler.last_step_skipped

    @property
    def events(self) -> EventLog:
        """The record of skips and scale changes."""
        return self.scaler.events

    # ------------------------------------------------------------------ masters

    def master_params(self) -> list[gluon.Parameter]:
        """What the optimizer updates, one per parameter: the float32 master where the
        model parameter is low precision, else the parameter itself."""
        return self._ensure_prepared().masters()

    def master_grads(self, ctx: mx.Context | None = None) -> list[nd.NDArray]:
        """The gradients the update reads on ``ctx`` (default: the first context), after
        ``allreduce_grads()``: clip these."""
        ctx = ctx or self._contexts[0]
        return [m.grad(ctx) for p, m in self._ensure_prepared().pairs if p.grad_req != "null"]

    def reduce_dtype(self, param: gluon.Parameter) -> str:
        """The dtype ``param``'s gradient crosses the kvstore in."""
        return dtype_name(self._comm(param, self._ensure_prepared().master_for(param))[0].dtype)

    def _comm(self, param: gluon.Parameter, master: gluon.Parameter) -> list[nd.NDArray]:
        reduce = self.policy.reduce
        if dtype_name(master.dtype) == reduce:
            return master.list_grad()
        if dtype_name(param.dtype) == reduce:
            return param.list_grad()
        buffers = self._buffers.get(id(param))
        if buffers is None:
            buffers = [
                nd.zeros(g.shape, g.context, dtype=mx_dtype(reduce)) for g in param.list_grad()
            ]
            self._buffers[id(param)] = buffers
        return buffers

    # ------------------------------------------------------------------ the step

    def allreduce_grads(self) -> None:
        """Cast the model gradients into the master gradients and sum them over contexts and
        workers (once per iteration; ``update`` and ``step`` call it when you did not)."""
        masters = self._ensure_prepared()
        if self._reduced:
            return
        distributed.init_kvstore_eagerly(self)
        for i, param in enumerate(self._params):
            if param.grad_req == "null":
                continue
            master = masters.master_for(param)
            grads, comm, final = param.list_grad(), self._comm(param, master), master.list_grad()
            for src, dst in zip(grads, comm, strict=True):
                cast(src, dtype_name(dst.dtype), out=dst)
            if self._kvstore is not None:
                self._kvstore.pushpull(i, comm, priority=-i)
            for src, dst in zip(comm, final, strict=True):
                cast(src, dtype_name(dst.dtype), out=dst)
        self._reduced = True

    def unscale(self) -> None:
        """Divide the master gradients by the loss scale now (before clipping them).

        :raises StepOrderError: no scaled backward ran, or unscale was already called.
        """
        self._tracker.on_unscale()
        self.allreduce_grads()
        if self.scaler.enabled:
            inverse = 1.0 / self.scaler.scale
            for grads in self._trainable_grads():
                for grad in grads:
                    grad *= inverse

    def step(self, batch_size: int, ignore_stale_grad: bool = False) -> None:
        """Reduce, unscale, check, and update or skip; then update the loss scale."""
        self.update(batch_size, ignore_stale_grad)

    def update(self, batch_size: int, ignore_stale_grad: bool = False) -> None:
        """Check for overflow and update (or skip) after ``allreduce_grads`` (and ``unscale``)."""
        tracker = self._tracker
        if not self.scaler.enabled and tracker.stage is Stage.READY and tracker.backwards == 0:
            tracker.on_backward()  # no scaling: a plain loss.backward() is as good
        unscaled = tracker.stage is Stage.UNSCALED
        tracker.on_step()
        try:
            self.allreduce_grads()
            scale = self.scaler.scale
            skipped = self.scaler.update(self._found_inf())
            if skipped:
                self._consume(ignore_stale_grad)
            else:
                unscale = 1.0 if unscaled or not self.scaler.enabled else scale
                self._optimizer.rescale_grad = self._scale / (batch_size * unscale)
                self._update(ignore_stale_grad)
        finally:
            self._reduced = False
            tracker.on_update()

    def _trainable_grads(self) -> Iterator[list[nd.NDArray]]:
        for param, master in self.masters.pairs:  # type: ignore[union-attr]
            if param.grad_req != "null":
                yield master.list_grad()

    def _found_inf(self) -> bool:
        per_context = list(zip(*self._trainable_grads(), strict=True))
        if not per_context:
            return False
        flags = [_count_nonfinite(grads) for grads in per_context]
        return bool(distributed.all_reduce_found_inf(self._kvstore, flags).asscalar() > 0)

    def _fresh(self, param: gluon.Parameter, ignore_stale_grad: bool) -> list[bool]:
        """Which contexts' gradients of ``param`` to use (gluon.Trainer's stale check)."""
        fresh = [data._fresh_grad for data in param.list_data()]
        if ignore_stale_grad:
            return fresh
        if not all(fresh):
            raise UserWarning(
                f"Gradient of Parameter `{param.name}` has not been updated by backward since "
                "last `step`. Call step with ignore_stale_grad=True to skip updating it."
            )
        return fresh

    def _consume(self, ignore_stale_grad: bool) -> None:
        for param in self._params:
            if param.grad_req != "null":
                self._fresh(param, ignore_stale_grad)
                for data in param.list_data():
                    data._fresh_grad = False

    def _update(self, ignore_stale_grad: bool = False) -> None:
        updates: list[list[tuple[int, nd.NDArray, nd.NDArray]]] = [[] for _ in self._updaters]
        copies = []
        for i, param in enumerate(self._params):
            if param.grad_req == "null":
                continue
            master = self.masters.master_for(param)  # type: ignore[union-attr]
            fresh = self._fresh(param, ignore_stale_grad)
            rows = zip(
                updates,
                fresh,
                param.list_data(),
                master.list_grad(),
                master.list_data(),
                strict=True,
            )
            for upd, ok, data, grad, weight in rows:
                if ok:
                    upd.append((i, grad, weight))
                    data._fresh_grad = False
                    if weight is not data:
                        copies.append((weight, data))
        for updater, upd in zip(self._updaters, updates, strict=True):
            if upd:
                indices, grads, weights = zip(*upd, strict=True)
                updater(list(indices), list(grads), list(weights))
        for weight, data in copies:
            cast(weight, dtype_name(data.dtype), out=data)
            if self._transient:
                cast(data, dtype_name(weight.dtype), out=weight)

    # ------------------------------------------------------------------ checkpoints

    def save_states(self, fname: str) -> None:
        """Save the optimizer state, the loss-scaler state and the policy."""
        self._ensure_prepared()
        checkpoint.save_states(self, fname)

    def load_states(self, fname: str) -> None:
        """Load what :meth:`save_states` wrote (the policy must match this trainer's)."""
        self._ensure_prepared()
        checkpoint.load_states(self, fname)
        self._tracker.reset()
        self._reduced = False

    def save_parameters(self, fname: str, deduplicate: bool = False) -> None:
        """Save the parameters as float32 master values (``net.save_parameters`` does this
        too when the Trainer was given the net)."""
        checkpoint.save_parameters(self, fname, deduplicate=deduplicate)

    def load_parameters(self, fname: str, **kwargs: Any) -> None:
        """Load float32 values into the masters, then cast them into the model."""
        checkpoint.load_parameters(self, fname, **kwargs)


def _count_nonfinite(arrays: Sequence[nd.NDArray]) -> nd.NDArray:
    """How many of ``arrays`` hold an inf or NaN (one element, on the arrays' context).

    One ``all_finite`` per array: MXNet 1.9's fused ``multi_all_finite`` is about 50x slower
    on CPU (37 ms against 0.7 ms for a 1M-parameter CNN), more than the whole update.
    """
    flags = [nd.all_finite(a if a.dtype != _BF16 else cast(a, FLOAT32)) for a in arrays]
    return len(flags) - nd.add_n(*flags)


def _check_dense(params: Sequence[gluon.Parameter]) -> None:
    sparse = [p.name for p in params if p._stype != "default" or p._grad_stype != "default"]
    if sparse:
        raise WrapError(
            f"sparse parameters or gradients ({', '.join(sparse[:3])}) need "
            "update_on_kvstore=True in Gluon, which mixprec cannot use; use dense storage"
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
    if left_out:
        warnings.warn(
            f"Trainer got parameters, not the net, so policy {policy.label} cannot apply "
            f"{' or '.join(left_out)}. Pass the net itself: Trainer(net, ...)",
            MixprecWarning,
            stacklevel=3,
        )
