"""One dist_sync worker for ``test_dist_sync.py``: train a small net, write what it saw as JSON.

Run by the test as ``python _dist_worker.py MODE CASE POLICY INDEX OUTDIR`` with the DMLC_*
variables of a worker set. POLICY is a preset with a bf16 compute dtype (``O1-bf16``,
``O2-bf16``); the loss scale is always an explicit dynamic one. MODE picks the training loop:

- ``gluon``: a plain ``gluon.Trainer`` (``update_on_kvstore=False``) on a net converted by
  MXNet AMP to POLICY's compute dtype (O1-style only), driven by hand the way mixprec's
  Trainer drives it, with a ``LossScaler`` holding POLICY's loss scale and the two functions of
  ``mixprec_mxnet.step.distributed``. The overflow check runs on the *local*
  gradients before the reduce, so only the all-reduced flag can make the clean worker skip.
- ``mixprec``: ``mixprec.mxnet.Trainer`` under POLICY, as a user writes it.

CASE is ``skip`` (worker rank 1 puts an inf into one gradient at INJECT_STEP) or ``equal``
(plain training; rank 0 also trains a single-process copy on the concatenated batch) or
``dead`` (rank 1 exits at INJECT_STEP; rank 0 records the DistributedError it gets).
Each worker starts from differently seeded weights: the kvstore must broadcast rank 0's.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon, nd
from mxnet.contrib import amp

import mixprec.mxnet
from mixprec import get_policy
from mixprec.errors import MixprecWarning
from mixprec.kit import LossScaler
from mixprec_mxnet.bf16_kernels import Bf16IslandWarning, missing_bf16_cpu_ops
from mixprec_mxnet.step.distributed import all_reduce_found_inf, init_kvstore_eagerly

STEPS = 4
INJECT_STEP = 1
LOCAL_BATCH = 8
LEARNING_RATE = 0.5
INIT_SCALE = 2.0**10
GROWTH_INTERVAL = 2
LOSS_SCALE = f"dynamic(init={INIT_SCALE:g},interval={GROWTH_INTERVAL})"


def build_net(seed: int) -> gluon.HybridBlock:
    mx.random.seed(seed)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(16, in_units=8, activation="relu"), gluon.nn.Dense(4, in_units=16))
    net.initialize(mx.init.Normal(0.5))
    return net


def global_batch() -> tuple[nd.NDArray, nd.NDArray]:
    rng = np.random.RandomState(0)
    x = rng.randn(2 * LOCAL_BATCH, 8).astype("float32")
    y = rng.randn(2 * LOCAL_BATCH, 4).astype("float32")
    return nd.array(x), nd.array(y)


def param_values(params: Any) -> list[list[float]]:
    """Float32 values in collect_params() order (names carry per-instance prefixes)."""
    return [p.data().astype("float32").asnumpy().ravel().tolist() for p in params.values()]


def _without_missing_kernels(target: str) -> dict[str, Any]:
    """MXNet's own AMP lists with the ops this CPU has no bfloat16 kernel for moved to float32
    (what mixprec's O1 does with them), so the reference loop runs on such a CPU too."""
    from mxnet.contrib.amp.lists import symbol_bf16

    # only ops MXNet's lists name: convert_hybrid_block refuses any other (the probe also
    # covers _contrib_BatchNormWithReLU, which MXNet's AMP lists leave out)
    listed = {*symbol_bf16.BF16_FUNCS, *symbol_bf16.FP32_FUNCS, *symbol_bf16.BF16_FP32_FUNCS}
    missing = missing_bf16_cpu_ops() & listed if target == "bfloat16" else frozenset()
    if not missing:
        return {}
    return {
        "target_dtype_ops": [op for op in symbol_bf16.BF16_FUNCS if op not in missing],
        "fp32_ops": sorted(set(symbol_bf16.FP32_FUNCS) | missing),
        "conditional_fp32_ops": [
            entry for entry in symbol_bf16.CONDITIONAL_FP32_FUNCS if entry[0] not in missing
        ],
    }


class GluonLoop:
    """gluon.Trainer + mixprec_mxnet.step.distributed, stepped the way mixprec's Trainer steps."""

    def __init__(self, net: gluon.HybridBlock, kvstore: Any, policy_spec: str) -> None:
        policy = get_policy(policy_spec, loss_scale=LOSS_SCALE)
        assert policy.param == "float32", "the gluon loop does O1 (op casting) only"
        net.hybridize()
        net(nd.zeros((1, 8)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # infer_type chatter from the AMP graph pass
            self.net = amp.convert_hybrid_block(
                net,
                target_dtype=policy.compute,
                cast_optional_params=False,
                ctx=mx.cpu(),
                **_without_missing_kernels(policy.compute),
            )
        self.params = self.net.collect_params()
        self.trainer = gluon.Trainer(
            self.params,
            "sgd",
            {"learning_rate": LEARNING_RATE},
            kvstore=kvstore,
            update_on_kvstore=False,
        )
        init_kvstore_eagerly(self.trainer)
        self.scaler = LossScaler(policy.loss_scale)
        self.loss_fn = gluon.loss.L2Loss()

    def step(self, x: nd.NDArray, y: nd.NDArray, batch_size: int, inject: bool) -> dict[str, Any]:
        scale = self.scaler.scale
        with autograd.record():
            loss = self.loss_fn(self.net(x), y).sum()
            scaled = loss * scale
        scaled.backward()
        grads = [p.grad() for p in self.params.values()]
        if inject:
            grads[0][0, 0] = float("inf")
        local = 1.0 - nd.multi_all_finite(*grads, num_arrays=len(grads), init_output=True)
        init_kvstore_eagerly(self.trainer)
        self.trainer.allreduce_grads()
        found = all_reduce_found_inf(self.trainer._kvstore, local)
        skipped = self.scaler.update(bool(found.asscalar() > 0))
        if not skipped:
            self.trainer.update(batch_size * scale)  # rescale_grad = 1 / (batch * loss scale)
        return {
            "loss": float(loss.asscalar()),
            "scale": scale,
            "skipped": skipped,
            "local_found_inf": float(local.asscalar()),
            "found_inf": float(found.asscalar()),
        }

    def state(self) -> dict[str, Any]:
        return {
            "loss_scale": self.scaler.scale,
            "skipped_steps": self.scaler.skipped_steps,
            "params": param_values(self.params),
            "masters": param_values(self.params),
        }


class MixprecLoop:
    """mixprec.mxnet.Trainer, as a user writes it."""

    def __init__(self, net: gluon.HybridBlock, kvstore: Any, policy_spec: str) -> None:
        self.net = net
        self.params = net.collect_params()
        self.trainer = mixprec.mxnet.Trainer(
            net,
            "sgd",
            {"learning_rate": LEARNING_RATE},
            policy=policy_spec,
            kvstore=kvstore,
            loss_scale=LOSS_SCALE,
        )
        self.loss_fn = gluon.loss.L2Loss()

    def step(self, x: nd.NDArray, y: nd.NDArray, batch_size: int, inject: bool) -> dict[str, Any]:
        scale = self.trainer.loss_scale
        with autograd.record():
            loss = self.loss_fn(self.net(x), y).sum()
            with self.trainer.scale_loss(loss) as scaled:
                autograd.backward(scaled)
        if inject:
            next(iter(self.params.values())).grad()[0, 0] = float("inf")
        self.trainer.step(batch_size)
        return {
            "loss": float(loss.asscalar()),
            "scale": scale,
            "skipped": bool(self.trainer.last_step_skipped),
        }

    def state(self) -> dict[str, Any]:
        return {
            "loss_scale": self.trainer.loss_scale,
            "skipped_steps": self.trainer.skipped_steps,
            "params": param_values(self.params),
            "masters": param_values(
                {p.name: self.trainer.masters.master_for(p) for p in self.params.values()}
            ),
        }


LOOPS = {"gluon": GluonLoop, "mixprec": MixprecLoop}


def main(mode: str, case: str, policy: str, index: int, outdir: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run(mode, case, policy, index)
    result["mixprec_warnings"] = [
        f"{w.category.__name__}: {w.message}"
        for w in caught
        if issubclass(w.category, MixprecWarning) and not issubclass(w.category, Bf16IslandWarning)
    ]
    tmp = outdir / f"worker{index}.json.tmp"
    tmp.write_text(json.dumps(result))
    tmp.rename(outdir / f"worker{index}.json")  # atomic: the test never reads half a file
    if case == "dead":  # the engine still waits for the dead worker: no clean shutdown
        import os

        os._exit(0)


def run(mode: str, case: str, policy: str, index: int) -> dict[str, Any]:
    kvstore = mx.kv.create("dist_sync")
    rank, workers = kvstore.rank, kvstore.num_workers
    x, y = global_batch()
    shard = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    net = build_net(seed=100 + index)
    result: dict[str, Any] = {"rank": rank, "num_workers": workers, "mode": mode, "case": case}
    result["seeded_params"] = param_values(net.collect_params())
    loop = LOOPS[mode](net, kvstore, policy)
    initial = loop.state()
    result["initial_params"], result["initial_masters"] = initial["params"], initial["masters"]
    if case == "dead":
        return dead_worker(loop, rank, x[shard], y[shard], workers * LOCAL_BATCH, result)
    result["steps"] = [
        loop.step(
            x[shard],
            y[shard],
            batch_size=workers * LOCAL_BATCH,  # gradients are summed over workers
            inject=case == "skip" and rank == 1 and step == INJECT_STEP,
        )
        for step in range(STEPS)
    ]
    result.update(loop.state())
    if case == "equal" and rank == 0:
        # The same training on one process and the whole batch, from rank 0's weights.
        ref_net = build_net(seed=100 + index)
        for p, value in zip(
            ref_net.collect_params().values(), result["initial_masters"], strict=True
        ):
            p.set_data(nd.array(np.asarray(value, "float32").reshape(p.shape)))
        ref = LOOPS[mode](ref_net, None, policy)
        for _ in range(STEPS):
            ref.step(x, y, batch_size=workers * LOCAL_BATCH, inject=False)
        result["reference_masters"] = ref.state()["masters"]
    nd.waitall()
    return result


def dead_worker(
    loop: Any, rank: int, x: nd.NDArray, y: nd.NDArray, batch_size: int, result: dict[str, Any]
) -> dict[str, Any]:
    """CASE ``dead``: rank 1 dies at INJECT_STEP (before its backward); rank 0 must get a
    DistributedError within MIXPREC_OVERFLOW_TIMEOUT, not hang."""
    import os
    import time

    from mixprec.errors import DistributedError

    for step in range(STEPS):
        if rank == 1 and step == INJECT_STEP:
            os._exit(0)  # a crash: no goodbye to the scheduler or the server
        started = time.monotonic()
        try:
            loop.step(x, y, batch_size=batch_size, inject=False)
        except DistributedError as err:
            result.update(error=str(err), waited=time.monotonic() - started, step=step)
            return result
    result["error"] = None
    return result


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), Path(sys.argv[5]))
