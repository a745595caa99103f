"""Master weights for the Gluon Trainer: make them, cast the model, and broadcast rank 0's.

:func:`prepare` runs once the parameters have shapes (in the Trainer's constructor, or just
before the first forward pass for deferred shapes): it pairs each unique parameter with a
float32 master (the parameter itself where it stays float32), casts the model parameters to
the policy's dtypes (``amp_cast``, round to nearest) and initialises the kvstore keys so that
every context and every worker starts from rank 0's values, as ``gluon.Trainer`` does
(:func:`init_params`, the Trainer's ``_init_params``).

Key initialisation differs from Gluon's in one way: a key is created in the dtype the
gradients are *reduced* in (``policy.reduce``), which may differ from both the master's and
the parameter's dtype (float16 reduce with float32 masters). Such a key cannot carry the
masters' exact values, so their broadcast goes through a key of its own (see
:data:`BROADCAST_KEY_BASE`).
"""

from __future__ import annotations

import functools

from mxnet import gluon

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
from ..step.protocol import comm, write_model
from ..step.trainer_state import TrainerState
from .casting import cast_param

__all__ = [
    "BROADCAST_KEY_BASE",
    "ensure_prepared",
    "init_params",
    "prepare",
    "sync_transient_masters",
]

#: Parameter ``i``'s exact-value broadcast key when its reduce key has another dtype. Gluon
#: keys parameters 0..n-1 and :data:`~mixprec_mxnet.step.distributed.FOUND_INF_KEY` is
#: 200,003; ps-lite needs int keys below about 215,000, so up to 100,000 parameters fit in
#: between.
BROADCAST_KEY_BASE = 100_000


def prepare(st: TrainerState, trainer: gluon.Trainer) -> None:
    """Make the masters, cast the parameters, create the kvstore and sync the weights."""
    planned = {id(p): dtype for p, dtype in st.plan}
    strategy = st.policy.master_strategy
    # MXNet has no bfloat16 optimizer kernels: without float32 masters in the policy (O3,
    # or a compensated strategy), the update runs on float32 working copies that hold
    # the rounded weights (plus the compensation under kahan) between steps
    no_copy = st.policy.master is None or strategy is not None
    st.transient = no_copy and BFLOAT16 in planned.values()
    st.masters = MasterWeights(
        st.params,
        master_dtype=FLOAT32 if st.transient else None if no_copy else st.policy.master,
        dtype_of=lambda p: planned.get(id(p), dtype_name(p.dtype)),
        make_master=functools.partial(_make_master, st),
    )
    for param, dtype in st.plan:
        cast_param(param, dtype)
    st.accumulation.track(st.masters.pairs)
    if strategy is not None:  # the masters still hold the exact float32 values here
        # in the net's order, not gluon.Trainer's (sorted by global names, which differ
        # between two copies of a net): the random stream must follow the parameters
        structural = st.tree.structural if st.tree is not None else st.params
        order = {id(p): i for i, p in enumerate(structural)}
        pairs = sorted(compensated_pairs(st.masters.pairs), key=lambda pm: order.get(id(pm[0]), -1))
        st.compensation = Compensation(pairs, strategy, st.seed)
    sync_transient_masters(st)
    lowp = [p.name for p, dtype in st.plan if is_low_precision(dtype)]
    check_scaler_without_masters(st.policy, [] if st.policy.master else lowp)
    distributed.init_kvstore_eagerly(trainer)


def ensure_prepared(st: TrainerState, trainer: gluon.Trainer) -> MasterWeights[gluon.Parameter]:
    """The masters, made now if the parameters got their shapes some other way than the
    net's first forward pass (``load_parameters``, parameters given without the net).

    :raises StepOrderError: a parameter still waits for its shape.
    """
    if st.masters is None:
        if any(is_deferred(p) for p in st.params):
            raise StepOrderError(
                "the parameters are not initialised yet: run a forward pass (net(x)) "
                "before stepping, saving or loading the trainer"
            )
        prepare(st, trainer)
    assert st.masters is not None
    return st.masters


def _make_master(st: TrainerState, param: gluon.Parameter) -> gluon.Parameter:
    dtype = FLOAT32 if st.transient else st.policy.master or FLOAT32
    master = gluon.Parameter(param.name, shape=param.shape, dtype=mx_dtype(dtype))
    value = cast(default_layout(param.list_data()[0]), dtype)
    init_from(master, value, param.list_ctx())
    return master


def sync_transient_masters(st: TrainerState) -> None:
    """Reset float32 update copies to the low-precision weights (policies without
    masters: the weights keep only their own precision between steps; under kahan the
    copies hold weight + compensation)."""
    if st.masters is not None and st.transient:
        comp = st.compensation
        for param, master in st.masters.copied_pairs():
            for data, weight in zip(param.list_data(), master.list_data(), strict=True):
                if comp is None or not comp.handles(weight):
                    cast_into(default_layout(data), weight)
        if comp is not None:
            comp.fill()


def init_params(st: TrainerState, trainer: gluon.Trainer) -> None:
    """``gluon.Trainer._init_params`` for mixprec: Gluon broadcasts the model weights; mixprec
    broadcasts what the optimizer updates (the masters), initialising each key in the dtype
    its gradients are reduced in."""
    if st.masters is None:
        return
    pending = []
    for param in trainer._params_to_init:
        if is_deferred(param):
            pending.append(param)
        elif trainer._kvstore is not None:
            _broadcast(st, trainer, param)
    trainer._params_to_init = pending


def _broadcast(st: TrainerState, trainer: gluon.Trainer, param: gluon.Parameter) -> None:
    """Give every context and worker rank 0's master (and weight) of ``param``.

    Every branch ends with a pull: under ``dist_sync``, ``init`` stores rank 0's value
    on the server and only the pull brings it to the other workers.
    """
    assert st.masters is not None
    kvstore = trainer._kvstore
    idx = trainer._param2idx[param.name]
    master = st.masters.master_for(param)
    weights = master.list_data()
    arrays = comm(st, param, master) if param.grad_req != "null" else weights
    if arrays[0].dtype == weights[0].dtype:
        kvstore.broadcast(idx, weights[0], out=weights)
    else:
        # The gradient key must exist in the reduce dtype (pushpull needs it), but
        # pulling the weights through it would round the float32 masters to that dtype.
        if distributed.is_distributed(kvstore):
            # other workers: exact values through a key of the masters' dtype
            kvstore.broadcast(_broadcast_key(idx), weights[0], out=weights)
        else:
            for weight in weights[1:]:  # one worker: its contexts copy the first
                weights[0].copyto(weight)
        kvstore.init(idx, cast(weights[0], dtype_name(arrays[0].dtype)))
    if master is not param:
        for data, value in zip(param.list_data(), weights, strict=True):
            write_model(st, value, data)


def _broadcast_key(idx: int) -> int:
    key = BROADCAST_KEY_BASE + idx
    if key >= distributed.FOUND_INF_KEY:
        raise WrapError(
            f"parameter {idx} has no free kvstore key for its broadcast (mixprec reserves "
            f"{BROADCAST_KEY_BASE}..{distributed.FOUND_INF_KEY - 1}); with this many "
            "parameters, reduce in the masters' dtype (policy reduce=float32)"
        )
    return key
