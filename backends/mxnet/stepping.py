"""The Trainer's step: reduce, unscale, overflow check, then update or skip.

:class:`Stepping` is the part of :class:`~mixprec_mxnet.trainer.Trainer` that runs every
iteration. ``step`` = ``allreduce_grads`` (model gradients cast into the float32 master
gradients and summed over contexts and workers in the policy's ``reduce`` dtype) +
``update`` (overflow check on every context, combined across workers; the loss-scale state
machine; then the optimizer on the masters with ``1/scale`` and ``1/batch_size`` folded
into ``rescale_grad``, and the masters cast back into the model, or a skip that leaves
weights and optimizer state untouched). Under ``master=kahan|stochastic`` the update runs
on float32 working values that :mod:`~.compensated.compensation` fills before it and rounds
back into the bfloat16 weights after it.

Cost per step beyond ``gluon.Trainer``'s update, for O2 with float32 masters: one
``amp_cast`` per gradient (model -> master), one ``dot`` per gradient (its squared norm, for
the overflow check: :func:`count_nonfinite`), and one ``amp_cast`` per weight (master ->
model). The optimizer itself goes through Gluon's
updater, which already uses MXNet's multi-tensor kernels where the optimizer has them
(``multi_sgd_mom_update``...). No scaling (the bfloat16 default) adds no multiplication:
``rescale_grad`` carries the batch size alone.
"""

from __future__ import annotations

import math
import numbers
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

from mxnet import gluon, nd

from mixprec.errors import WrapError
from mixprec.kit import FLOAT32, NORM_LIMIT, LossScaler, OverflowRecord, Stage, StepTracker

from .dtypes import cast, cast_into, mx_dtype
from .gluon_private import consume_fresh_grad, has_fresh_grad
from .step import distributed
from .step.running_stats import RunningStats
from .step.trainer_state import names_by_id
from .wrapping.masters import MasterSetup

__all__ = [
    "KEPT_OVERFLOWS",
    "Stepping",
    "count_nonfinite",
    "named_pairs",
    "overflow_log",
    "record_overflows",
]

#: How many skipped steps' overflow records a trainer keeps.
KEPT_OVERFLOWS = 100

_F32 = mx_dtype(FLOAT32)


class Stepping(MasterSetup):
    """Mixin of :class:`~mixprec_mxnet.trainer.Trainer`: the per-iteration step."""

    scaler: LossScaler
    _tracker: StepTracker
    _reduced: bool
    _optimizer: Any
    _updaters: list[Any]
    _scale: float
    _running_stats: RunningStats | None

    def allreduce_grads(self) -> None:
        """Cast the model gradients into the master gradients and sum them over contexts and
        workers (once per iteration; ``update`` and ``step`` call it when you did not)."""
        masters = self._ensure_prepared()
        if self._reduced:
            return
        self._accumulation.check(self._params, self.policy.label)
        distributed.init_kvstore_eagerly(self)  # type: ignore[arg-type]
        kvstore = self._kvstore
        summed = {id(p) for p, _ in self._accumulation.accumulating()}
        for i, param in enumerate(self._params):
            if param.grad_req == "null":
                continue
            master = masters.master_for(param)
            comm, final = self._comm(param, master), master.list_grad()
            # grad_req='add' on a low-precision parameter: the master holds the float32 sum
            grads = final if id(param) in summed else param.list_grad()
            # `comm`/`final` are the model's own gradients where dtypes agree: no copy then
            if comm is not grads:
                for src, dst in zip(grads, comm, strict=True):
                    cast_into(src, dst)
            if kvstore is not None:
                kvstore.pushpull(i, comm, priority=-i)
            if final is not comm:
                for src, dst in zip(comm, final, strict=True):
                    cast_into(src, dst)
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
        _check_batch_size(batch_size)
        self._ensure_prepared()
        self._accumulation.check(self._params, self.policy.label)  # before anything moves
        tracker = self._tracker
        if not self.scaler.enabled and tracker.stage is Stage.READY and tracker.backwards == 0:
            tracker.on_backward()  # no scaling: a plain loss.backward() is as good
        unscaled = tracker.stage is Stage.UNSCALED
        tracker.on_step()
        try:
            self.allreduce_grads()
            scale = self.scaler.scale
            found_inf = self._found_inf()
            if self._running_stats is not None:  # before the update: a floor that raises
                self._running_stats.settle(found_inf)  # still restores the statistics
            overflowing: tuple[str, ...] = ()
            if found_inf:  # before the update, so skip hooks can already ask what overflowed
                overflowing = record_overflows(self.scaler.steps, [self])
            skipped = self.scaler.update(found_inf, overflowing)
            if skipped:
                self._consume(ignore_stale_grad)
            else:
                unscale = 1.0 if unscaled else scale  # NoScale's scale is 1.0
                self._optimizer.rescale_grad = self._scale / (batch_size * unscale)
                self._update(ignore_stale_grad)
        finally:
            self._reduced = False
            self._accumulation.stepped()
            tracker.on_update()

    def _trainable_grads(self) -> Iterator[list[nd.NDArray]]:
        for _, master in self._trainable_pairs():
            yield master.list_grad()

    def _found_inf(self) -> bool:
        per_context = list(zip(*self._trainable_grads(), strict=True))
        if not per_context:
            return False
        flags = [count_nonfinite(grads) for grads in per_context]
        stats = self._running_stats.flag() if self._running_stats is not None else None
        if stats is not None:  # a huge batch can overflow BatchNorm with finite gradients
            flags[0] = flags[0] + stats.as_in_context(flags[0].context)
        return bool(distributed.all_reduce_found_inf(self._kvstore, flags).asscalar() > 0)

    def _fresh(self, param: gluon.Parameter, ignore_stale_grad: bool) -> list[bool]:
        """Which contexts' gradients of ``param`` to use (gluon.Trainer's stale check)."""
        added = self._accumulation.added
        fresh = [has_fresh_grad(data) or added(data) for data in param.list_data()]
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
                    consume_fresh_grad(data)

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
                    consume_fresh_grad(data)
                    if weight is not data:
                        copies.append((weight, data))
        compensation = self._compensation
        if compensation is not None:  # master=kahan|stochastic: float32 working values
            compensation.fill()  # w + c (kahan) or w
        for updater, upd in zip(self._updaters, updates, strict=True):
            if upd:
                indices, grads, weights = zip(*upd, strict=True)
                updater(list(indices), list(grads), list(weights))
        if compensation is not None:  # round back into bfloat16, the residual or noise kept
            copies = compensation.store(copies)
        for weight, data in copies:
            self._write_model(weight, data)


def count_nonfinite(arrays: Sequence[nd.NDArray]) -> nd.NDArray:
    """1 when ``arrays`` are unsafe to apply, else 0 (one element, on the arrays' context):
    an array holds an inf or NaN, or the sum of their squared norms overflows float32
    (:mod:`mixprec.guard`).

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


def named_pairs(trainer: Stepping) -> list[tuple[str, gluon.Parameter, gluon.Parameter]]:
    """(name, model parameter, master) for every parameter with a gradient; names as
    ``net.save_parameters`` keys them (``"0.weight"``)."""
    names = names_by_id(trainer)  # type: ignore[arg-type]
    return [(names.get(id(p), p.name), p, m) for p, m in trainer._trainable_pairs()]


def overflow_log(trainer: Stepping) -> deque[OverflowRecord]:
    """The trainer's :class:`mixprec.OverflowRecord`\\ s, oldest first (the last 100)."""
    records: deque[OverflowRecord] | None = getattr(trainer, "_overflows", None)
    if records is None:
        records = deque(maxlen=KEPT_OVERFLOWS)
        trainer._overflows = records  # type: ignore[attr-defined]
    return records


def record_overflows(step: int, members: Sequence[Stepping]) -> tuple[str, ...]:
    """Record, for each trainer of a skipped step, which parameters' master gradients
    overflowed (an inf or NaN, or a squared norm beyond float32's range; when only the sum
    over several parameters overflows, the one with the largest norm is named). The same
    argument order as every backend's ``record_overflows``; returns every name found.

    Called by the step only when the overflow check fired, so a normal step pays nothing.
    """
    every: dict[str, None] = {}
    limit = NORM_LIMIT * NORM_LIMIT
    for trainer in members:
        named = named_pairs(trainer)
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
        overflow_log(trainer).append(OverflowRecord(step, found))
    return tuple(every)


def _check_batch_size(batch_size: Any) -> None:
    # before the tracker and the scaler move: step(0) used to count a step, then divide by 0
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Real) or batch_size <= 0:
        raise WrapError(
            f"trainer.step(batch_size) needs a positive batch size (the number of samples the "
            f"gradients were summed over), got {batch_size!r}; pass x.shape[0]"
        )
