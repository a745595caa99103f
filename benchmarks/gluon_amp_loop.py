"""The contrib.amp tutorial loop on model_zoo's resnet18_v1, per-step losses by policy and seed
(issue 37: "the drop-in under ``amp.init(policy='O2-bf16')`` spikes" on an AVX2 CPU).

``OMP_NUM_THREADS=1 python -m benchmarks.gluon_amp_loop`` trains ``resnet18_v1`` (10 classes,
Xavier init, hybridized) on one fixed random batch of 16 3x32x32 images, SGD with momentum
0.9, through ``mixprec.compat.mxnet_amp`` exactly as MXNet's AMP tutorial writes the loop
(``amp.init``, ``amp.init_trainer``, ``amp.scale_loss``), for each policy and seed, and prints
each run's losses and, per policy, the largest loss after step 8 and the final loss of each
seed. ``float32`` is the same loop without amp. A loss that jumps up after falling is a
*bump*; the table says whether a policy's bumps are larger than float32's own across seeds.
Each run is a fresh process (``amp.init`` is process-wide). Not one of ``python -m
benchmarks``' cases: a development measurement, quoted in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def run(policy: str, seed: int, steps: int, lr: float) -> list[float]:
    """One training run in this process: the loss of each step."""
    import warnings

    import mxnet as mx
    import numpy as np
    from mxnet import autograd, gluon, nd
    from mxnet.gluon.model_zoo import vision

    from mixprec.compat import mxnet_amp as amp

    warnings.simplefilter("ignore")  # the island warning on a CPU without bf16 kernels
    mx.random.seed(seed)
    amped = policy != "float32"
    if amped:
        amp.init(policy=policy)
    net = vision.resnet18_v1(classes=10)
    net.initialize(mx.init.Xavier(magnitude=2.24))
    net.hybridize()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": lr, "momentum": 0.9})
    if amped:
        amp.init_trainer(trainer)
    rng = np.random.RandomState(seed)
    x = nd.array(rng.randn(16, 3, 32, 32).astype("float32"))
    y = nd.array(rng.randint(0, 10, 16).astype("float32"))
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    losses = []
    for _ in range(steps):
        with autograd.record():
            loss = loss_fn(net(x), y).mean()
            if amped:
                with amp.scale_loss(loss, trainer) as scaled:
                    autograd.backward(scaled)
            else:
                loss.backward()
        trainer.step(1)
        losses.append(float(loss.asscalar()))
    return losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="float32,O1-bf16,O2-bf16")
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--one", nargs=2, metavar=("POLICY", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run(args.one[0], int(args.one[1]), args.steps, args.lr)))
        return
    rows: dict[str, list[list[float]]] = {}
    for seed in range(args.seeds):
        for policy in args.policies.split(","):
            one = ["--one", policy, str(seed), "--steps", str(args.steps), "--lr", str(args.lr)]
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.gluon_amp_loop", *one],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            losses = json.loads(out.strip().splitlines()[-1])
            rows.setdefault(policy, []).append(losses)
            print(f"{policy:10} seed {seed}: " + " ".join(f"{v:.3g}" for v in losses), flush=True)
    print(f"\nlr {args.lr}: largest loss after step 8 / final loss, by seed")
    for policy, runs in rows.items():
        cells = [f"{max(r[8:], default=float('nan')):.3g} / {r[-1]:.2g}" for r in runs]
        print(f"{policy:10} " + " | ".join(cells))


if __name__ == "__main__":
    main()
