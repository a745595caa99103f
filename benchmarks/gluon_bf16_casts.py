"""Gluon bfloat16 policies where ops run as float32 islands: the casts, before and after
(issue 37: the contrib.amp drop-in's O2-bf16 ran ~20x float32's step on an AVX2 CPU).

``OMP_NUM_THREADS=1 python -m benchmarks.gluon_bf16_casts`` trains model_zoo's
``resnet18_v1`` (10 classes, batch 16 of 3x32x32, SGD with momentum, hybridized) and times
its steps under ``O0``, ``O1-bf16`` and ``O2-bf16``, each bfloat16 policy twice in the same
process:

- ``amp_cast``: every float32 <-> bfloat16 conversion by MXNet's ``amp_cast`` /
  ``amp_multicast``, as before (O1's island rounding as ``amp_cast`` pairs, the islands'
  graph casts, the step's master copies);
- ``float32 ops``: as mixprec does now (:mod:`mixprec_mxnet.bf16_rounding`, Veltkamp's
  splitting with ``Cast``; the same bits, which the run checks on the final weights).

Each row is the median of ``--steps`` steps after two warm-up steps (wall time: one
thread). On a CPU with bfloat16 kernels (AVX512-BF16) there are few islands and both
columns are close. Not one of ``python -m benchmarks``' cases: a development measurement,
quoted in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings
from collections.abc import Iterator

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon, nd
from mxnet.gluon.model_zoo import vision

from mixprec_mxnet import Trainer
from mixprec_mxnet.dtypes import BFLOAT16_NP
from mixprec_mxnet.o1 import graph
from mixprec_mxnet.step import multi_tensor
from mixprec_mxnet.wrapping import islands


@contextlib.contextmanager
def amp_cast_everywhere() -> Iterator[None]:
    """The conversions as they were: ``amp_cast`` and ``amp_multicast`` only."""
    saved = (
        graph.BFLOAT16_NAME,
        multi_tensor.FAST_CAST_SIZE,
        islands.symbol_to_bf16,
        islands.symbol_from_bf16,
    )
    graph.BFLOAT16_NAME = "none"  # round_islands then uses amp_cast pairs
    multi_tensor.FAST_CAST_SIZE = 1 << 62
    islands.symbol_to_bf16 = lambda v: mx.sym.amp_cast(v, dtype=BFLOAT16_NP)
    islands.symbol_from_bf16 = lambda v: mx.sym.amp_cast(v, dtype="float32")
    try:
        yield
    finally:
        (
            graph.BFLOAT16_NAME,
            multi_tensor.FAST_CAST_SIZE,
            islands.symbol_to_bf16,
            islands.symbol_from_bf16,
        ) = saved


def run(policy: str, steps: int) -> tuple[float, list[np.ndarray]]:
    """Median seconds per step, and the final weights."""
    mx.random.seed(0)
    net = vision.resnet18_v1(classes=10)
    net.initialize(mx.init.Xavier())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the island warning
        trainer = Trainer(net, "sgd", {"learning_rate": 0.01, "momentum": 0.9}, policy=policy)
    net.hybridize()
    rng = np.random.default_rng(0)
    x = nd.array(rng.normal(size=(16, 3, 32, 32)).astype(np.float32))
    y = nd.array(rng.integers(0, 10, size=16))
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    times = []
    for step in range(steps + 2):
        start = time.perf_counter()
        with autograd.record():
            loss = loss_fn(net(x), y)
        with trainer.scale_loss(loss) as scaled:
            scaled.backward()
        trainer.step(16)
        nd.waitall()
        if step >= 2:
            times.append(time.perf_counter() - start)
    weights = [p.data().asnumpy().astype(np.float32) for p in net.collect_params().values()]
    return statistics.median(times), weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    base, _ = run("O0", args.steps)
    print(f"{'policy':10} {'casts':12} {'ms/step':>9} {'x O0':>6}")
    print(f"{'O0':10} {'-':12} {base * 1e3:9.1f} {1.0:6.2f}")
    for policy in ("O1-bf16", "O2-bf16"):
        with amp_cast_everywhere():
            slow, before = run(policy, args.steps)
        fast, after = run(policy, args.steps)
        same = all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
        print(f"{policy:10} {'amp_cast':12} {slow * 1e3:9.1f} {slow / base:6.2f}")
        print(f"{policy:10} {'float32 ops':12} {fast * 1e3:9.1f} {fast / base:6.2f}")
        print(f"{'':10} same weights after {args.steps + 2} steps: {same}")


if __name__ == "__main__":
    main()
