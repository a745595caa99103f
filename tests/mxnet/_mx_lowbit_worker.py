"""One ``dist_sync`` worker for ``test_mx_lowbit.py``: Adam under ``state=int8`` on a small
net, rank 1 putting an inf into a gradient at step 1; writes what it saw as JSON.

Run as ``python _mx_lowbit_worker.py OUTDIR`` with the DMLC_* variables of a worker set.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon, nd

import mixprec.mxnet
from mixprec_mxnet.lowbit.state import LowBitArray

STEPS, INJECT_STEP, LOCAL_BATCH = 4, 1, 8


def _codes(trainer: Any) -> str:
    """One digest of every state array's codes and absmax (the first context's)."""
    digest = hashlib.sha256()
    for index, state in sorted(trainer._updaters[0].states.items()):
        for array in state:
            assert isinstance(array, LowBitArray)
            digest.update(str(index).encode())
            digest.update(array.codes.asnumpy().tobytes())
            digest.update(array.absmax.asnumpy().tobytes())
    return digest.hexdigest()


def main(outdir: Path) -> None:
    kvstore = mx.kv.create("dist_sync")
    rank = kvstore.rank
    mx.random.seed(100 + rank)  # different weights: the kvstore broadcasts rank 0's
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(16, in_units=8, activation="relu"), gluon.nn.Dense(4, in_units=16))
    net.initialize(mx.init.Normal(0.5))
    trainer = mixprec.mxnet.Trainer(
        net,
        "adam",
        {"learning_rate": 0.01},
        policy="O2-bf16,state=int8(block=32,min_size=0)",
        kvstore=kvstore,
        loss_scale="dynamic(init=1024)",
    )
    rng = np.random.RandomState(0)
    x = nd.array(rng.randn(2 * LOCAL_BATCH, 8).astype("float32"))
    y = nd.array(rng.randn(2 * LOCAL_BATCH, 4).astype("float32"))
    shard = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    loss_fn = gluon.loss.L2Loss()
    skipped, codes = [], []
    for step in range(STEPS):
        with autograd.record():
            loss = loss_fn(net(x[shard]), y[shard]).sum()
            with trainer.scale_loss(loss) as scaled:
                autograd.backward(scaled)
        if rank == 1 and step == INJECT_STEP:
            net[0].weight.grad()[0, 0] = float("inf")
        trainer.step(2 * LOCAL_BATCH)
        skipped.append(bool(trainer.last_step_skipped))
        codes.append(_codes(trainer))
    masters = [
        trainer.masters.master_for(p).data().asnumpy().tobytes().hex()
        for p in net.collect_params().values()
    ]
    result = {"rank": rank, "skipped": skipped, "codes": codes, "masters": masters}
    nd.waitall()
    tmp = outdir / f"worker{rank}.json.tmp"
    tmp.write_text(json.dumps(result))
    tmp.rename(outdir / f"worker{rank}.json")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
