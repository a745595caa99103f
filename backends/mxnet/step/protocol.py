"""The Trainer's step, top to bottom: scale the loss, reduce, unscale, check, update or skip.

Functions over the data-only :class:`~.trainer_state.TrainerState` and the ``gluon.Trainer``
whose optimizer, updaters and kvstore they drive; :class:`~mixprec_mxnet.trainer.Trainer`
calls them (``trainer.step`` = ``update``, which reduces first when ``allreduce_grads`` did
not). The iteration:

1. :func:`scale_loss`: the loss times the loss scale, for the user's backward; under
   ``grad_req='add'`` each backward's low-precision gradients are summed into the masters'
   float32 gradients as it leaves.
2. :func:`reduce_grads`: the model gradients cast into the float32 master gradients and summed
   over contexts and workers in the policy's ``reduce`` dtype.
3. :func:`unscale` (optional, before clipping): the master gradients divided by the scale.
4. :func:`update`: the ``grad_req='add'`` check (once), the overflow check on every context
   combined across workers, BatchNorm's statistics put back on a skip, the overflow records,
   the loss-scale state machine; then the optimizer on the masters with ``1/scale`` and
   ``1/batch_size`` folded into ``rescale_grad`` and the masters cast back into the model
   (:func:`write_model`), or a skip that leaves weights and optimizer state untouched.
   Under ``master=kahan|stochastic`` the update runs on float32 working values that
   :mod:`~..compensated.compensation` fills before it and rounds back into the bfloat16
   weights after it; with ``state="bfloat16"`` the compensated parameters' optimizer state
   is widened from bfloat16 into float32 before each context's update and rounded back
   stochastically after the weights (``StateRounding`` in that module). Under a low-bit
   ``state`` (``int8``, ``int4``, ``fp8``) the optimizer's state is decoded into float32
   before each context's update and encoded after the model is written
   (:mod:`~..lowbit.state`).

Cost per step beyond ``gluon.Trainer``'s update, for O2 with float32 masters, per context:
one ``amp_multicast`` for all gradients (model -> master), ``multi_sum_sq`` + ``sum`` +
``all_finite`` for the overflow check, and one ``amp_multicast`` for all weights (master ->
model); SGD, momentum, AdamW and LAMB update every master in one multi-tensor op per 45-50
arrays, Adam one ``adam_update`` per parameter (:mod:`.multi_tensor`, issue 34).
``MIXPREC_MXNET_MULTI_TENSOR=0`` keeps the per-parameter path: one ``amp_cast`` per gradient,
one ``dot`` per gradient (:func:`count_nonfinite`), one ``amp_cast`` per weight and Gluon's
updater. No scaling (the bfloat16 default) adds no multiplication: ``rescale_grad`` carries
the batch size alone.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Iterator, Sequence
from typing import Any

from mxnet import autograd, gluon, nd

from mixprec.errors import WrapError
from mixprec.kit import FLOAT32, NORM_LIMIT, OverflowRecord, Stage

from ..dtypes import cast, cast_into, dtype_name, mx_dtype
from ..gluon_private import consume_fresh_grad, has_fresh_grad
from . import distributed, multi_tensor
from .trainer_state import TrainerState, names_by_id, state_rounding

__all__ = [
    "check_batch_size",
    "comm",
    "count_nonfinite",
    "named_pairs",
    "record_overflows",
    "reduce_grads",
    "scale_loss",
    "trainable_grads",
    "trainable_pairs",
    "unscale",
    "update",
    "write_model",
]

_F32 = mx_dtype(FLOAT32)


# ---------------------------------------------------------------------- 1. scale the loss


@contextlib.contextmanager
def scale_loss(st: TrainerState, loss: Any) -> Iterator[Any]:
    """Yield ``loss`` (or a list of losses) times the current loss scale, for backward;
    inside ``autograd.record()`` or right after it."""
    st.tracker.on_backward()
    if not st.scaler.enabled:
        yield loss
    else:
        scale = st.scaler.scale
        with contextlib.ExitStack() as stack:
            if not autograd.is_recording():
                stack.enter_context(autograd.record())
            if isinstance(loss, (list, tuple)):
                scaled = [part * scale for part in loss]
            else:
                scaled = loss * scale
        yield scaled
    if st.masters is not None:  # the backward ran: grad_req='add' sums in float32
        st.accumulation.after_backward()


# ---------------------------------------------------------------------- 2. reduce


def trainable_pairs(st: TrainerState) -> list[tuple[gluon.Parameter, gluon.Parameter]]:
    """(model parameter, master) for every parameter with a gradient (masters made)."""
    assert st.masters is not None
    return [(p, m) for p, m in st.masters.pairs if p.grad_req != "null"]


def trainable_grads(st: TrainerState) -> Iterator[list[nd.NDArray]]:
    """The master gradients of every parameter with a gradient, one list per parameter."""
    for _, master in trainable_pairs(st):
        yield master.list_grad()


def comm(st: TrainerState, param: gluon.Parameter, master: gluon.Parameter) -> list[nd.NDArray]:
    """The arrays ``param``'s gradient crosses the kvstore in, one per context: the
    master's or the parameter's gradients where one has the reduce dtype, else buffers."""
    reduce = st.policy.reduce
    if dtype_name(master.dtype) == reduce:
        return list(master.list_grad())
    if dtype_name(param.dtype) == reduce:
        return list(param.list_grad())
    buffers = st.buffers.get(id(param))
    if buffers is None:
        buffers = [nd.zeros(g.shape, g.context, dtype=mx_dtype(reduce)) for g in param.list_grad()]
        st.buffers[id(param)] = buffers
    return buffers


def reduce_grads(st: TrainerState, trainer: gluon.Trainer) -> None:
    """Cast the model gradients into the master gradients and sum them over contexts and
    workers (the masters are made; the caller ran the ``grad_req='add'`` check)."""
    assert st.masters is not None
    distributed.init_kvstore_eagerly(trainer)
    kvstore = trainer._kvstore
    summed = {id(p) for p, _ in st.accumulation.accumulating()}
    # the casts batched: one amp_multicast per dtype pair (issue 34)
    staged: list[tuple[int, list[nd.NDArray], list[nd.NDArray]]] = []
    casts: list[tuple[nd.NDArray, nd.NDArray]] = []
    for i, param in enumerate(st.params):
        if param.grad_req == "null":
            continue
        master = st.masters.master_for(param)
        arrays, final = comm(st, param, master), master.list_grad()
        # grad_req='add' on a low-precision parameter: the master holds the float32 sum
        grads = final if id(param) in summed else param.list_grad()
        # `arrays`/`final` are the model's own gradients where dtypes agree: no copy then
        if arrays is not grads:
            casts.extend(zip(grads, arrays, strict=True))
        staged.append((i, arrays, final))
    _cast_all(casts)
    casts = []
    for i, arrays, final in staged:
        if kvstore is not None:
            kvstore.pushpull(i, arrays, priority=-i)
        if final is not arrays:
            casts.extend(zip(arrays, final, strict=True))
    _cast_all(casts)
    st.reduced = True


def _cast_all(pairs: Sequence[tuple[nd.NDArray, nd.NDArray]]) -> None:
    """``cast_into`` each (source, target) pair: batched on the multi-tensor path."""
    if multi_tensor.enabled():
        multi_tensor.cast_pairs(pairs)
    else:
        for src, dst in pairs:
            cast_into(src, dst)


# ---------------------------------------------------------------------- 3. unscale


def unscale(st: TrainerState) -> None:
    """Divide the reduced master gradients by the loss scale."""
    if st.scaler.enabled:
        inverse = 1.0 / st.scaler.scale
        for grads in trainable_grads(st):
            for grad in grads:
                grad *= inverse


# ---------------------------------------------------------------------- 4. check, update or skip


def update(
    st: TrainerState, trainer: gluon.Trainer, batch_size: int, ignore_stale_grad: bool
) -> None:
    """Check for overflow and update (or skip) after the reduce (and ``unscale``), reducing
    first where it has not run; then update the loss scale. The masters are made."""
    st.accumulation.check(st.params, st.policy.label)  # before anything moves
    tracker = st.tracker
    if not st.scaler.enabled and tracker.stage is Stage.READY and tracker.backwards == 0:
        tracker.on_backward()  # no scaling: a plain loss.backward() is as good
    unscaled = tracker.stage is Stage.UNSCALED
    tracker.on_step()
    try:
        if not st.reduced:  # checked above: the reduce itself need not check again
            reduce_grads(st, trainer)
        scale = st.scaler.scale
        found_inf = _found_inf(st, trainer)
        if st.running_stats is not None:  # before the update: a floor that raises
            st.running_stats.settle(found_inf)  # still restores the statistics
        overflowing: tuple[str, ...] = ()
        if found_inf:  # before the update, so skip hooks can already ask what overflowed
            overflowing = record_overflows(st.scaler.steps, [st])
        kv = trainer._kvstore if found_inf else None  # a worker's rank: in the skip warning
        rank = kv.rank if kv is not None and distributed.is_distributed(kv) else None
        skipped = st.scaler.update(found_inf, overflowing, rank=rank)
        if skipped:
            _consume(st, ignore_stale_grad)
        else:
            unscale_by = 1.0 if unscaled else scale  # NoScale's scale is 1.0
            trainer._optimizer.rescale_grad = trainer._scale / (batch_size * unscale_by)
            _update(st, trainer, ignore_stale_grad)
    finally:
        st.reduced = False
        st.accumulation.stepped()
        tracker.on_update()


def _found_inf(st: TrainerState, trainer: gluon.Trainer) -> bool:
    per_context = list(zip(*trainable_grads(st), strict=True))
    if not per_context:
        return False
    check = multi_tensor.count_nonfinite if multi_tensor.enabled() else count_nonfinite
    flags = [check(grads) for grads in per_context]
    stats = st.running_stats.flag() if st.running_stats is not None else None
    if stats is not None:  # a huge batch can overflow BatchNorm with finite gradients
        flags[0] = flags[0] + stats.as_in_context(flags[0].context)
    return bool(distributed.all_reduce_found_inf(trainer._kvstore, flags).asscalar() > 0)


def _fresh(st: TrainerState, param: gluon.Parameter, ignore_stale_grad: bool) -> list[bool]:
    """Which contexts' gradients of ``param`` to use (gluon.Trainer's stale check)."""
    added = st.accumulation.added
    fresh = [has_fresh_grad(data) or added(data) for data in param.list_data()]
    if ignore_stale_grad:
        return fresh
    if not all(fresh):
        raise UserWarning(
            f"Gradient of Parameter `{param.name}` has not been updated by backward since "
            "last `step`. Call step with ignore_stale_grad=True to skip updating it."
        )
    return fresh


def _consume(st: TrainerState, ignore_stale_grad: bool) -> None:
    for param in st.params:
        if param.grad_req != "null":
            _fresh(st, param, ignore_stale_grad)
            for data in param.list_data():
                consume_fresh_grad(data)


def _update(st: TrainerState, trainer: gluon.Trainer, ignore_stale_grad: bool) -> None:
    assert st.masters is not None
    updates: list[list[tuple[int, nd.NDArray, nd.NDArray]]] = [[] for _ in trainer._updaters]
    copies = []
    for i, param in enumerate(st.params):
        if param.grad_req == "null":
            continue
        master = st.masters.master_for(param)
        fresh = _fresh(st, param, ignore_stale_grad)
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
                consume_fresh_grad(data)
                if weight is not data:
                    copies.append((weight, data))
    compensation, lowbit, bf16_state = st.compensation, st.lowbit, state_rounding(st)
    if compensation is not None:  # master=kahan|stochastic: float32 working values
        compensation.fill()  # w + c (kahan) or w
    if lowbit is not None:
        lowbit.begin()
    if bf16_state is not None:
        bf16_state.begin()
    for updater, upd in zip(trainer._updaters, updates, strict=True):
        if upd:
            indices, grads, weights = zip(*upd, strict=True)
            if lowbit is not None:  # state=int8|int4|fp8: the codes decoded into float32
                lowbit.widen(updater, indices, weights)
            if bf16_state is not None:  # state=bfloat16: widened into float32, exactly
                bf16_state.widen(updater, indices, weights)
            multi_tensor.update(updater, indices, grads, weights)  # or updater(...)
    if compensation is not None:  # round back into bfloat16, the residual or noise kept
        copies = compensation.store(copies)
    _write_models(st, copies)
    if lowbit is not None:  # encoded again, after the model is written: a refused
        lowbit.narrow()  # moment (PolicyError) leaves the masters and the model in step
    if bf16_state is not None:  # after the weights' noise: the same stream, net order
        bf16_state.narrow()


def _write_models(st: TrainerState, copies: Sequence[tuple[nd.NDArray, nd.NDArray]]) -> None:
    """:func:`write_model` for each (master, model data) pair: batched on the multi-tensor
    path (the pairs a strategy keeps were taken out by its ``store``)."""
    if multi_tensor.enabled():
        _cast_all(copies)
        if st.transient:
            _cast_all([(data, weight) for weight, data in copies])
        return
    for weight, data in copies:
        write_model(st, weight, data)


def write_model(st: TrainerState, weight: nd.NDArray, data: nd.NDArray) -> None:
    """Cast a master's ``weight`` into the model's ``data`` (one context). Without masters
    in the policy, the float32 update copy is then reset to the rounded weight (under
    kahan, the rounding error goes into the compensation)."""
    if st.compensation is not None and st.compensation.handles(weight):
        st.compensation.split(weight, data)
        return
    cast_into(weight, data)
    if st.transient:
        cast_into(data, weight)


def check_batch_size(batch_size: Any) -> None:
    """Refuse a batch size that is not a positive number, before the tracker and the scaler
    move (``step(0)`` used to count a step, then divide by 0)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Real) or batch_size <= 0:
        raise WrapError(
            f"trainer.step(batch_size) needs a positive batch size (the number of samples the "
            f"gradients were summed over), got {batch_size!r}; pass x.shape[0]"
        )


def count_nonfinite(arrays: Sequence[nd.NDArray]) -> nd.NDArray:
    """1 when ``arrays`` are unsafe to apply, else 0 (one element, on the arrays' context):
    an array holds an inf or NaN, or the sum of their squared norms overflows float32
    (:mod:`mixprec.numerics.guard`).

    One float32 ``dot`` of each flattened array with itself (its squared norm; bfloat16
    arrays are cast first, ``dot`` has no bfloat16 kernel) does both checks, since an inf or
    NaN element gives an inf or NaN sum, and so does a sum beyond float32's range. ``dot``
    runs BLAS (``sdot``): 1.6 ms for a 2048x2048 gradient where ``norm``'s overflow-safe
    reduction took 61 ms and ``all_finite`` 26 ms (one thread, AVX512 Zen 4), which made
    the guard a quarter of an O2-bf16 MLP step. The squares are summed on the device: no
    host sync.
    """
    squares = []
    for a in arrays:
        flat = (a if a.dtype == _F32 else cast(a, FLOAT32)).reshape((-1,))
        squares.append(nd.dot(flat, flat).reshape((1,)))
    total = nd.concat(*squares, dim=0) if len(squares) > 1 else squares[0]
    return 1 - nd.all_finite(nd.sum(total))


# ---------------------------------------------------------------------- overflow records


def named_pairs(st: TrainerState) -> list[tuple[str, gluon.Parameter, gluon.Parameter]]:
    """(name, model parameter, master) for every parameter with a gradient; names as
    ``net.save_parameters`` keys them (``"0.weight"``)."""
    names = names_by_id(st)
    return [(names.get(id(p), p.name), p, m) for p, m in trainable_pairs(st)]


def record_overflows(step: int, members: Sequence[TrainerState]) -> tuple[str, ...]:
    """Record, for each trainer of a skipped step, which parameters' master gradients
    overflowed (an inf or NaN, or a squared norm beyond float32's range; when only the sum
    over several parameters overflows, the one with the largest norm is named). The same
    argument order as every backend's ``record_overflows``; returns every name found.

    Called by the step only when the overflow check fired, so a normal step pays nothing.
    """
    every: dict[str, None] = {}
    limit = NORM_LIMIT * NORM_LIMIT
    for st in members:
        named = named_pairs(st)
        squares: list[float] = []
        for _, _, master in named:
            grads = master.list_grad()
            per_ctx = [nd.norm(g if g.dtype == _F32 else cast(g, FLOAT32)) for g in grads]
            values = [float(n.asscalar()) ** 2 for n in per_ctx]
            squares.append(max(v if v == v else math.inf for v in values))  # NaN counts as inf
        found = tuple(
            dict.fromkeys(
                n for (n, _, _), sq in zip(named, squares, strict=True) if not sq <= limit
            )
        )
        if not found and squares and sum(squares) > limit:  # only the sum overflowed
            found = (named[max(range(len(squares)), key=squares.__getitem__)][0],)
        every.update(dict.fromkeys(found))
        st.overflows.append(OverflowRecord(step, found))
    return tuple(every)
