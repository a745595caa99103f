"""Master weights for the Gluon Trainer: make them, cast the model, and broadcast rank 0's.

:class:`MasterSetup` is the part of :class:`~mixprec_mxnet.trainer.Trainer` that runs once
the parameters have shapes (in the constructor, or just before the first forward pass for
deferred shapes): it pairs each unique parameter with a float32 master (the parameter itself
where it stays float32), casts the model parameters to the policy's dtypes (``amp_cast``,
round to nearest) and initialises the kvstore keys so that every context and every worker
starts from rank 0's values, as ``gluon.Trainer`` does.

Key initialisation differs from Gluon's in one way: a key is created in the dtype the
gradients are *reduced* in (``policy.reduce``), which may differ from both the master's and
the parameter's dtype (float16 reduce with float32 masters). Such a key cannot carry the
masters' exact values, so their broadcast goes through a key of its own (see
:data:`BROADCAST_KEY_BASE`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mxnet import gluon, nd

from mixprec.errors import StepOrderError, WrapError
from mixprec.kit import (
    BFLOAT16,
    FLOAT32,
    MasterWeights,
    check_scaler_without_masters,
    is_low_precision,
)

from ..compensated.compensation import Compensation, compensated_pairs
from ..dtypes import cast, cast_into, default_layout, dtype_name, mx_dtype
from ..gluon_private import init_from, is_deferred
from ..step import distributed
from ..step.accumulation import Accumulation
from .casting import cast_param

if TYPE_CHECKING:
    from mixprec.kit import Policy

    from ..blocks import BlockTree

__all__ = ["BROADCAST_KEY_BASE", "MasterSetup"]

#: Parameter ``i``'s exact-value broadcast key when its reduce key has another dtype. Gluon
#: keys parameters 0..n-1 and :data:`~mixprec_mxnet.step.distributed.FOUND_INF_KEY` is 200,003;
#: ps-lite needs int keys below about 215,000, so up to 100,000 parameters fit in between.
BROADCAST_KEY_BASE = 100_000


class MasterSetup:
    """Mixin of :class:`~mixprec_mxnet.trainer.Trainer`: masters, parameter casts, broadcast.

    Reads the attributes the Trainer's constructor sets (``policy``, ``_plan``, ``masters``,
    ``_transient``) and gluon.Trainer's (``_params``, ``_kvstore``, ``_param2idx``...).
    """

    policy: Policy
    masters: MasterWeights[gluon.Parameter] | None
    _compensation: Compensation | None
    _accumulation: Accumulation
    _seed: int
    _tree: BlockTree | None
    _plan: list[tuple[gluon.Parameter, str]]
    _transient: bool
    _buffers: dict[int, list[nd.NDArray]]
    _params: list[gluon.Parameter]
    _params_to_init: list[gluon.Parameter]
    _param2idx: dict[str, int]
    _kvstore: Any

    def _prepare(self) -> None:
        """Make the masters, cast the parameters, create the kvstore and sync the weights."""
        planned = {id(p): dtype for p, dtype in self._plan}
        strategy = self.policy.master_strategy
        # MXNet has no bfloat16 optimizer kernels: without float32 masters in the policy (O3,
        # or a compensated strategy), the update runs on float32 working copies that hold
        # the rounded weights (plus the compensation under kahan) between steps
        no_copy = self.policy.master is None or strategy is not None
        self._transient = no_copy and BFLOAT16 in planned.values()
        self.masters = MasterWeights(
            self._params,
            master_dtype=FLOAT32 if self._transient else None if no_copy else self.policy.master,
            dtype_of=lambda p: planned.get(id(p), dtype_name(p.dtype)),
            make_master=self._make_master,
        )
        for param, dtype in self._plan:
            cast_param(param, dtype)
        self._accumulation.track(self.masters.pairs)
        if strategy is not None:  # the masters still hold the exact float32 values here
            # in the net's order, not gluon.Trainer's (sorted by global names, which differ
            # between two copies of a net): the random stream must follow the parameters
            order = {id(p): i for i, p in enumerate(self._structural_params())}
            pairs = sorted(
                compensated_pairs(self.masters.pairs), key=lambda pm: order.get(id(pm[0]), -1)
            )
            self._compensation = Compensation(pairs, strategy, self._seed)
        self.sync_transient_masters()
        lowp = [p.name for p, dtype in self._plan if is_low_precision(dtype)]
        check_scaler_without_masters(self.policy, [] if self.policy.master else lowp)
        distributed.init_kvstore_eagerly(self)  # type: ignore[arg-type]

    def _structural_params(self) -> list[gluon.Parameter]:
        """The net's parameters in its own order (``"0.weight"``, ``"0.bias"``...: the
        construction's walk kept it); the Trainer's order when it was given parameters."""
        if self._tree is None:
            return list(self._params)
        return list(self._tree.structural)

    def _make_master(self, param: gluon.Parameter) -> gluon.Parameter:
        dtype = FLOAT32 if self._transient else self.policy.master or FLOAT32
        master = gluon.Parameter(param.name, shape=param.shape, dtype=mx_dtype(dtype))
        value = cast(default_layout(param.list_data()[0]), dtype)
        init_from(master, value, param.list_ctx())
        return master

    def sync_transient_masters(self) -> None:
        """Reset float32 update copies to the low-precision weights (policies without
        masters: the weights keep only their own precision between steps; under kahan the
        copies hold weight + compensation)."""
        if self.masters is not None and self._transient:
            comp = self._compensation
            for param, master in self.masters.copied_pairs():
                for data, weight in zip(param.list_data(), master.list_data(), strict=True):
                    if comp is None or not comp.handles(weight):
                        cast_into(default_layout(data), weight)
            if comp is not None:
                comp.fill()

    def _write_model(self, weight: nd.NDArray, data: nd.NDArray) -> None:
        """Cast a master's ``weight`` into the model's ``data`` (one context). Without masters
        in the policy, the float32 update copy is then reset to the rounded weight (under
        kahan, the rounding error goes into the compensation)."""
        if self._compensation is not None and self._compensation.handles(weight):
            self._compensation.split(weight, data)
            return
        cast_into(weight, data)
        if self._transient:
            cast_into(data, weight)

    def _trainable_pairs(self) -> list[tuple[gluon.Parameter, gluon.Parameter]]:
        """(model parameter, master) for every parameter with a gradient."""
        return [(p, m) for p, m in self._ensure_prepared().pairs if p.grad_req != "null"]

    def _ensure_prepared(self) -> MasterWeights[gluon.Parameter]:
        if self.masters is None:
            if any(is_deferred(p) for p in self._params):
                raise StepOrderError(
                    "the parameters are not initialised yet: run a forward pass (net(x)) "
                    "before stepping, saving or loading the trainer"
                )
            self._prepare()
        assert self.masters is not None
        return self.masters

    def reduce_dtype(self, param: gluon.Parameter) -> str:
        """The dtype ``param``'s gradient crosses the kvstore in."""
        return dtype_name(self._comm(param, self._ensure_prepared().master_for(param))[0].dtype)

    def _comm(self, param: gluon.Parameter, master: gluon.Parameter) -> list[nd.NDArray]:
        """The arrays ``param``'s gradient crosses the kvstore in, one per context: the
        master's or the parameter's gradients where one has the reduce dtype, else buffers."""
        reduce = self.policy.reduce
        if dtype_name(master.dtype) == reduce:
            return list(master.list_grad())
        if dtype_name(param.dtype) == reduce:
            return list(param.list_grad())
        buffers = self._buffers.get(id(param))
        if buffers is None:
            buffers = [
                nd.zeros(g.shape, g.context, dtype=mx_dtype(reduce)) for g in param.list_grad()
            ]
            self._buffers[id(param)] = buffers
        return buffers

    def _init_params(self) -> None:
        # Gluon broadcasts the model weights; mixprec broadcasts what the optimizer updates
        # (the masters), initialising each key in the dtype its gradients are reduced in.
        if self.masters is None:
            return
        pending = []
        for param in self._params_to_init:
            if is_deferred(param):
                pending.append(param)
            elif self._kvstore is not None:
                self._broadcast(param)
        self._params_to_init = pending

    def _broadcast(self, param: gluon.Parameter) -> None:
        """Give every context and worker rank 0's master (and weight) of ``param``.

        Every branch ends with a pull: under ``dist_sync``, ``init`` stores rank 0's value
        on the server and only the pull brings it to the other workers.
        """
        idx = self._param2idx[param.name]
        master = self.masters.master_for(param)  # type: ignore[union-attr]
        weights = master.list_data()
        comm = self._comm(param, master) if param.grad_req != "null" else weights
        if comm[0].dtype == weights[0].dtype:
            self._kvstore.broadcast(idx, weights[0], out=weights)
        else:
            # The gradient key must exist in the reduce dtype (pushpull needs it), but
            # pulling the weights through it would round the float32 masters to that dtype.
            if distributed.is_distributed(self._kvstore):
                # other workers: exact values through a key of the masters' dtype
                self._kvstore.broadcast(_broadcast_key(idx), weights[0], out=weights)
            else:
                for weight in weights[1:]:  # one worker: its contexts copy the first
                    weights[0].copyto(weight)
            self._kvstore.init(idx, cast(weights[0], dtype_name(comm[0].dtype)))
        if master is not param:
            for data, value in zip(param.list_data(), weights, strict=True):
                self._write_model(value, data)


def _broadcast_key(idx: int) -> int:
    key = BROADCAST_KEY_BASE + idx
    if key >= distributed.FOUND_INF_KEY:
        raise WrapError(
            f"parameter {idx} has no free kvstore key for its broadcast (mixprec reserves "
            f"{BROADCAST_KEY_BASE}..{distributed.FOUND_INF_KEY - 1}); with this many "
            "parameters, reduce in the masters' dtype (policy reduce=float32)"
        )
    return key
