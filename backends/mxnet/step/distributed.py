"""Distributed training with a KVStore: eager kvstore set-up and the cross-worker overflow vote.

mixprec's :class:`~mixprec_mxnet.Trainer` is a ``gluon.Trainer`` with
``update_on_kvstore=False``: gradients are summed through the kvstore (``pushpull``), and the
unscale, the overflow check, the skip and the optimizer update all happen on the worker. Two
things must then hold under ``dist_sync`` that plain Gluon does not guarantee:

1. **The kvstore exists and holds rank 0's weights before the first gradient is pushed.**
   Gluon creates its kvstore lazily in the first ``step``; it then broadcasts the weights
   (``init`` + ``pull`` into the parameters) and pushes the gradients in the same breath. The
   pull writes the parameters and the push reads the gradients, so MXNet's engine may run them
   in either order; when the gradient push of both workers reaches the server first, the pull
   returns the *gradient sum* and that worker's weights become it (seen with plain
   ``gluon.Trainer`` too, in about half of the two-worker runs we tried).
   :func:`init_kvstore_eagerly`
   creates the kvstore, broadcasts every initialised parameter and waits for the pulls.
2. **Every worker skips the same steps.** Each worker decides locally whether its gradients
   overflowed; :func:`all_reduce_found_inf` sums the per-worker flags through a reserved
   kvstore key so they all see the same verdict and their loss scales never diverge.

How the Trainer calls this module (``trainer`` is the ``gluon.Trainer`` mixprec drives, with
``update_on_kvstore=False``; ``mixprec_mxnet.trainer.Trainer`` is one and calls them so)::

    # Trainer.__init__, once the parameters have their final dtypes (and masters exist):
    init_kvstore_eagerly(trainer)

    # Trainer.step(batch_size) / allreduce_grads(), before the first pushpull:
    init_kvstore_eagerly(trainer)      # no-op, except where weights got their shapes only
                                       # in the first forward: create/broadcast them now
    ...                                # pushpull of every gradient (sum over contexts, workers)
    flags = [nonfinite count of grads of ctx for ctx in contexts]      # after the reduce
    found_inf = all_reduce_found_inf(trainer._kvstore, flags)
    skipped = scaler.update(bool(found_inf.asscalar() > 0))
    # skip, or update with rescale_grad = 1 / (batch_size * loss_scale)

Both calls are collective under ``dist_sync``: every worker must make them, in the same
order, on every step (a skipped step still reduces its gradients and its flag). Checking
after the reduce already gives every worker the same verdict for dense float gradients (an
inf or NaN survives the sum); the vote keeps that true wherever a check runs on local
values (before the reduce, per-worker clipping) and makes the contract explicit.

Limits, each refused with a message rather than left to hang:

- The dist server cannot sum bfloat16 arrays (it aborts, and the workers wait forever). Under a
  dist kvstore what crosses it (``trainer.reduce_dtype(param)`` where the trainer has that
  method, else the parameter's dtype) must be float32 or float16.
- Gradient compression needs ``update_on_kvstore=True`` (MXNet refuses ``pushpull`` with it),
  which mixprec cannot use: the skip and the masters live on the worker.
- ``dist_async`` cannot skip together; Gluon already refuses it with ``update_on_kvstore=False``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import mxnet as mx
from mxnet import nd

from mixprec.errors import DistributedError, PolicyError, UnsupportedDtypeError, WrapError
from mixprec.kit import BFLOAT16

from ..dtypes import dtype_name
from ..gluon_private import is_deferred

__all__ = [
    "ENV_TIMEOUT",
    "FOUND_INF_KEY",
    "all_reduce_found_inf",
    "bounded_wait",
    "init_kvstore_eagerly",
    "is_distributed",
    "overflow_timeout",
]

#: The setting torch's backend reads for its overflow all-reduce: one bound for both.
ENV_TIMEOUT = "MIXPREC_OVERFLOW_TIMEOUT"
DEFAULT_TIMEOUT = 300.0


def overflow_timeout() -> float:
    """Seconds a worker waits for the others in the step's collectives under a dist
    kvstore (``MIXPREC_OVERFLOW_TIMEOUT``, default 300; read at each wait)."""
    raw = os.environ.get(ENV_TIMEOUT)
    if raw is None or not raw.strip():
        return DEFAULT_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise PolicyError(
            f"{ENV_TIMEOUT} must be a positive, finite number of seconds, got {raw!r}; "
            f"the default is {DEFAULT_TIMEOUT:g}"
        )
    return seconds


def bounded_wait(arrays: Sequence[nd.NDArray], what: str) -> None:
    """Wait for ``arrays`` (results of kvstore collectives) at most :func:`overflow_timeout`
    seconds, then raise :class:`~mixprec.errors.DistributedError`.

    MXNet's engine waits in C++ with no timeout, and ps-lite's ``dist_sync`` waits for every
    worker's push without bound: a worker that died leaves the others blocked for ever. The
    wait runs on a helper thread; this thread gives up after the bound. The engine itself
    stays blocked, so the process cannot train on: the error says to exit and restart the
    job from its last checkpoint.
    """
    timeout = overflow_timeout()
    done = threading.Event()

    def wait() -> None:
        try:
            for array in arrays:
                array.wait_to_read()
        except BaseException:
            pass
        finally:
            done.set()

    threading.Thread(target=wait, name="mixprec-kvstore-wait", daemon=True).start()
    if not done.wait(timeout):
        raise DistributedError(
            f"{what} waited {timeout:g} s ({ENV_TIMEOUT}) for the other dist kvstore "
            "workers: one of them died or stalls (a crash, data loading, a failed host). "
            "MXNet cannot cancel the wait, so this process cannot train on: exit (os._exit, "
            "the engine does not shut down cleanly now) and restart the job from its last "
            f"checkpoint; raise {ENV_TIMEOUT} if a worker is only slow"
        )


#: The kvstore key that carries the overflow flags. Gluon keys parameters 0..n-1; ps-lite
#: hashes an int key as ``key * 9973`` in 32 bits, so a reserved key must stay below
#: 2**31 / 9973 (about 215,000).
FOUND_INF_KEY = 200_003

# set on a native KVStore once FOUND_INF_KEY has been initialised on it (init is collective)
_FLAG_READY_ATTR = "_mixprec_found_inf_ready"


def is_distributed(kvstore: Any) -> bool:
    """Whether ``kvstore`` spans several workers (``dist_*``, Horovod, BytePS...)."""
    if kvstore is None:
        return False
    if "dist" in str(getattr(kvstore, "type", "")):
        return True
    return int(getattr(kvstore, "num_workers", 1)) > 1


def init_kvstore_eagerly(trainer: mx.gluon.Trainer) -> Any:
    """Create ``trainer``'s kvstore now and broadcast rank 0's weights; return the kvstore.

    Idempotent and cheap once everything is initialised, so the Trainer calls it in its
    constructor and again at the start of each ``step`` (parameters whose deferred
    initialisation finished after the constructor are broadcast on that first step, before
    any gradient is pushed). Returns ``None`` where Gluon uses no kvstore (one context, no
    ``dist``), and while a parameter still waits for its shape: Gluon cannot size the kvstore
    before that, so it is created by the call at the start of the first step.

    Under a dist kvstore this is collective: every worker must call it. A parameter still
    waiting for its shape at construction keeps each worker's own random values for the first
    forward pass; give the net its input shapes (``in_units``...) or run one forward pass
    before building the Trainer so that the first gradients already come from rank 0's
    weights.

    Raises :class:`~mixprec.errors.WrapError` when the kvstore would update on the server or
    uses gradient compression, and :class:`~mixprec.errors.UnsupportedDtypeError` when a
    bfloat16 gradient would be sent to a dist server.
    """
    created = False
    if not trainer._kv_initialized:
        if any(is_deferred(p) for p in trainer._params):
            # Gluon sizes the kvstore from the weights; the first step calls this again
            # once the forward pass has given them shapes, still before any gradient push.
            return None
        trainer._init_kvstore()
        created = True
    kvstore = trainer._kvstore
    if kvstore is None or not (created or trainer._params_to_init):
        return kvstore  # the per-step call, once everything is set up
    distributed = is_distributed(kvstore)
    if trainer._update_on_kvstore:
        raise WrapError(
            f"the {kvstore.type!r} kvstore updates the weights on the server "
            "(update_on_kvstore=True), so mixprec cannot unscale, skip overflowed steps or "
            "keep float32 masters; build the gluon.Trainer with update_on_kvstore=False"
        )
    if distributed and trainer._compression_params:
        raise WrapError(
            "gradient compression needs update_on_kvstore=True, which mixprec cannot use "
            "(skips and master weights live on the worker); drop compression_params"
        )
    if distributed:
        _check_reducible_dtypes(trainer)
    if trainer._params_to_init:
        pending = list(trainer._params_to_init)
        trainer._init_params()
        still_deferred = {id(p) for p in trainer._params_to_init}
        # The broadcast pulls write the weights asynchronously; wait for them so no gradient
        # push of this worker can overtake them at the server.
        pulled = [
            arr for param in pending if id(param) not in still_deferred for arr in param.list_data()
        ]
        if distributed:
            bounded_wait(pulled, "the kvstore's first broadcast of the weights")
        for arr in pulled:
            arr.wait_to_read()
    if distributed:
        _init_flag_key(kvstore)
    return kvstore


def all_reduce_found_inf(kvstore: Any, found_inf: nd.NDArray | Sequence[nd.NDArray]) -> nd.NDArray:
    """How many ``found_inf`` flags are set over all workers: a float32 NDArray of shape (1,).

    ``found_inf`` is this worker's flag (nonzero, NaN included, means "gradients not finite"),
    or one flag per context. Under a dist kvstore every worker gets the same count, so all
    of them skip a step together when any of them overflowed: skip when the result is > 0.
    With ``None`` or a single-process kvstore (``local``, ``device``) nothing crosses
    processes: the count is this worker's own (0 or 1 per given flag). The result is on the
    context of the (first) flag.

    Collective under a dist kvstore: every worker calls it once per step, in the same order.
    """
    flags = [found_inf] if isinstance(found_inf, nd.NDArray) else list(found_inf)
    if not flags:
        raise ValueError("all_reduce_found_inf needs at least one found_inf flag")
    ctx = flags[0].context
    local = nd.zeros((1,), ctx=mx.cpu(), dtype="float32")
    for flag in flags:
        # `!= 0` turns NaN into 1 too; 0/1 per context keeps the sum a count
        local += (flag.as_in_context(mx.cpu()).astype("float32").reshape((-1,)) != 0).max()
    if not is_distributed(kvstore):
        return local.as_in_context(ctx)
    if isinstance(kvstore, mx.kvstore.KVStore):
        _init_flag_key(kvstore)
    total = nd.zeros((1,), ctx=mx.cpu(), dtype="float32")
    # pushpull, as gluon.Trainer does for dense gradients: with no updater on the server,
    # dist_sync stores the sum of one push per worker and every pull returns that sum
    kvstore.pushpull(FOUND_INF_KEY, local, out=total)
    # the one host read of the step, after every gradient's pushpull: bounded (a dead worker)
    bounded_wait([total], "the step's overflow check (a kvstore pushpull)")
    return total.as_in_context(ctx)


def _init_flag_key(kvstore: Any) -> None:
    """Initialise FOUND_INF_KEY once per native kvstore (collective: a barrier per worker)."""
    if not isinstance(kvstore, mx.kvstore.KVStore) or getattr(kvstore, _FLAG_READY_ATTR, False):
        return
    kvstore.init(FOUND_INF_KEY, nd.zeros((1,), ctx=mx.cpu(), dtype="float32"))
    setattr(kvstore, _FLAG_READY_ATTR, True)


def _check_reducible_dtypes(trainer: mx.gluon.Trainer) -> None:
    bf16 = [
        p.name
        for p in trainer._params
        if p.grad_req != "null" and p.dtype is not None and _reduce_dtype(trainer, p) == BFLOAT16
    ]
    if bf16:
        shown = ", ".join(bf16[:3]) + (" ..." if len(bf16) > 3 else "")
        raise UnsupportedDtypeError(
            f"the dist kvstore server cannot sum bfloat16 gradients ({shown}); it aborts and "
            "the workers hang. Reduce in float32: a policy with reduce=float32 (the presets' "
            "default), or float32 parameters in a plain gluon.Trainer"
        )


def _reduce_dtype(trainer: mx.gluon.Trainer, param: Any) -> str:
    """The dtype ``param``'s gradient crosses the kvstore in."""
    reduce_dtype = getattr(trainer, "reduce_dtype", None)  # mixprec's Trainer says
    if callable(reduce_dtype):
        return str(reduce_dtype(param))
    return dtype_name(param.dtype)  # plain Gluon pushes the gradient as it is
