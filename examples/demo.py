"""mixprec demo: one CNN, real data, several precision policies, every installed backend.

Trains a small convolutional network on scikit-learn's bundled handwritten-digits data
(1,797 8x8 images) under fp32 and the mixed-precision presets, on PyTorch, MXNet Gluon and
the NumPy reference plugin (an MLP there: it has no convolution), and prints test accuracy,
time per epoch, skipped steps and the final loss scale side by side. Then the precision
advisor (``examples/advise_demo.py``) trains short copies of the CNN under each policy the
machine runs and writes its report, recommended policy and plots into ``build/advice/``.

Run it with ``make demo`` (or ``.venv/bin/python examples/demo.py``). Each backend runs in
its own process so one framework's threads and globals never touch another's timing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any

# policy lists per backend: float16 GEMMs are ~100x slower than fp32 on this CPU in
# PyTorch and do not exist in MXNet on CPU, so the fp16 rows use the smaller data path.
POLICIES = {
    "torch": ["O0", "O1-bf16", "O2-bf16", "O3-bf16", "O2"],
    "mxnet": ["O0", "O1-bf16", "O2-bf16", "O2"],
    "numpy": ["O0", "O1", "O2", "O2-bf16"],
}
# 4 epochs reach ~99% on this CNN (98.9% fp32 on torch) and keep `make demo` under 3
# minutes on a 2-core CPU without fast bf16/fp16 (low-precision rows run ~2-3 s an epoch there)
EPOCHS = 4
BATCH = 64


@dataclass
class Result:
    backend: str
    policy: str
    accuracy: float | None = None
    seconds_per_epoch: float | None = None
    skipped_steps: int | None = None
    loss_scale: float | None = None
    note: str = ""


def digits(seed: int = 0) -> tuple[Any, Any, Any, Any]:
    """Standardised digits images (N, 1, 8, 8) and labels, split 80/20 with a fixed seed."""
    import numpy as np
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.images / 16.0).astype(np.float32)[:, None, :, :]
    x = (x - x.mean()) / x.std()
    y = data.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(0.8 * len(x))
    train, test = order[:cut], order[cut:]
    return x[train], y[train], x[test], y[test]


def batches(n: int, epoch: int) -> list[Any]:
    import numpy as np

    order = np.random.default_rng(1000 + epoch).permutation(n)
    return [order[i : i + BATCH] for i in range(0, n, BATCH)]


# ---------------------------------------------------------------------------------------
# PyTorch
# ---------------------------------------------------------------------------------------


def run_torch(policy: str) -> Result:
    import torch
    from torch import nn

    import mixprec.torch as mp

    torch.manual_seed(0)
    torch.set_num_threads(2)
    xtr, ytr, xte, yte = (torch.from_numpy(a) for a in digits())
    model = nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 16, 128), nn.ReLU(), nn.Linear(128, 10),
    )  # fmt: skip
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    model, optimizer = mp.wrap(model, optimizer, policy=policy)
    start = time.perf_counter()
    for epoch in range(EPOCHS):
        model.train()
        for idx in batches(len(xtr), epoch):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
            with mp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
    elapsed = (time.perf_counter() - start) / EPOCHS
    model.eval()
    with torch.no_grad():
        accuracy = (model(xte).argmax(1) == yte).float().mean().item()
    state = mp.state(optimizer)
    return Result("torch", policy, accuracy, elapsed, state.skipped_steps, state.loss_scale)


# ---------------------------------------------------------------------------------------
# MXNet Gluon
# ---------------------------------------------------------------------------------------


def run_mxnet(policy: str) -> Result:
    import mxnet as mx
    from mxnet import autograd, gluon

    import mixprec.mxnet as mpx
    from mixprec.errors import MixprecError
    from mixprec_mxnet.bf16_kernels import Bf16IslandWarning, missing_bf16_cpu_ops

    mx.random.seed(0)
    xtr, ytr, xte, yte = digits()
    net = gluon.nn.HybridSequential()
    net.add(
        gluon.nn.Conv2D(32, 3, padding=1), gluon.nn.BatchNorm(), gluon.nn.Activation("relu"),
        gluon.nn.Conv2D(64, 3, padding=1), gluon.nn.BatchNorm(), gluon.nn.Activation("relu"),
        gluon.nn.MaxPool2D(2), gluon.nn.Flatten(), gluon.nn.Dense(128, activation="relu"),
        gluon.nn.Dense(10),
    )  # fmt: skip
    net.initialize(mx.init.Xavier())
    net(mx.nd.array(xtr[:2]))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", Bf16IslandWarning)
            trainer = mpx.Trainer(net, "adam", {"learning_rate": 2e-3}, policy=policy)
    except MixprecError as exc:  # fp16 on a CPU context is refused up front
        advice = str(exc).split(". ")[-1].split(",")[0]  # "Use bfloat16 instead: policy=..."
        return Result("mxnet", policy, note=f"refused up front ({type(exc).__name__}): {advice}")
    # on a CPU without AVX512-BF16, MXNet has no bf16 GEMM/conv kernel: say what ran in fp32
    islands = sorted(missing_bf16_cpu_ops()) if caught else []
    note = f"fp32 islands (no bf16 kernel on this CPU): {', '.join(islands)}" if islands else ""
    net.hybridize(static_alloc=True)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    start = time.perf_counter()
    for epoch in range(EPOCHS):
        for idx in batches(len(xtr), epoch):
            x, y = mx.nd.array(xtr[idx]), mx.nd.array(ytr[idx])
            with autograd.record():
                loss = loss_fn(net(x), y)
                with trainer.scale_loss(loss) as scaled:
                    autograd.backward(scaled)
            trainer.step(len(idx))
        mx.nd.waitall()
    elapsed = (time.perf_counter() - start) / EPOCHS
    predictions = net(mx.nd.array(xte)).astype("float32").argmax(axis=1).asnumpy()
    accuracy = float((predictions == yte).mean())
    return Result(
        "mxnet", policy, accuracy, elapsed, trainer.skipped_steps, trainer.loss_scale, note
    )


# ---------------------------------------------------------------------------------------
# NumPy reference plugin
# ---------------------------------------------------------------------------------------


def run_numpy(policy: str) -> Result:
    import mixprec_numpy as mpn

    xtr, ytr, xte, yte = digits()
    xtr, xte = xtr.reshape(len(xtr), -1), xte.reshape(len(xte), -1)
    model = mpn.MLP([64, 128, 10], seed=0)
    trainer = mpn.Trainer(model, mpn.SGD(lr=0.05, momentum=0.9), policy=policy)
    start = time.perf_counter()
    for epoch in range(EPOCHS):
        for idx in batches(len(xtr), epoch):
            model.loss(xtr[idx], ytr[idx])
            trainer.backward()
            trainer.step()
    elapsed = (time.perf_counter() - start) / EPOCHS
    accuracy = float((model.predict(xte).argmax(axis=1) == yte).mean())
    return Result("numpy", policy, accuracy, elapsed, trainer.skipped_steps, trainer.loss_scale)


RUNNERS = {"torch": run_torch, "mxnet": run_mxnet, "numpy": run_numpy}


def run_backend(backend: str) -> list[Result]:
    results = []
    for policy in POLICIES[backend]:
        try:
            results.append(RUNNERS[backend](policy))
        except Exception as exc:  # show what failed and keep going with the other rows
            results.append(Result(backend, policy, note=f"error: {type(exc).__name__}: {exc}"))
    return results


def print_table(results: list[Result]) -> None:
    header = f"{'backend':<8}{'policy':<10}{'accuracy':>9}{'s/epoch':>9}{'skipped':>9}{'scale':>9}"
    print(header)
    print("-" * len(header))
    baseline: dict[str, float] = {}
    for r in results:
        if r.accuracy is None:
            print(f"{r.backend:<8}{r.policy:<10}  {r.note}")
            continue
        if r.policy == "O0":
            baseline[r.backend] = r.seconds_per_epoch or 1.0
        speed = ""
        if r.backend in baseline and r.seconds_per_epoch:
            speed = f"  {baseline[r.backend] / r.seconds_per_epoch:.2f}x fp32 speed"
        line = (
            f"{r.backend:<8}{r.policy:<10}{100 * r.accuracy:>8.1f}%{r.seconds_per_epoch:>9.3f}"
            f"{r.skipped_steps:>9}{r.loss_scale:>9.0f}{speed}  {r.note}"
        )
        print(line.rstrip())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=sorted(RUNNERS), help="run one backend in-process")
    args = parser.parse_args()
    if args.backend:
        print(json.dumps([asdict(r) for r in run_backend(args.backend)]))
        return 0
    print(f"mixprec demo: digits CNN, {EPOCHS} epochs, batch {BATCH}\n")
    results: list[Result] = []
    for backend in RUNNERS:
        proc = subprocess.run(
            [sys.executable, __file__, "--backend", backend],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            results.append(Result(backend, "-", note=f"backend failed: {tail}"))
            continue
        results.extend(Result(**row) for row in json.loads(proc.stdout.strip().splitlines()[-1]))
    print_table(results)
    return advise()


# ---------------------------------------------------------------------------------------
# The precision advisor on the same CNN (examples/advise_demo.py)
# ---------------------------------------------------------------------------------------


def advise() -> int:
    from advise_demo import advise_all  # examples/ is sys.path[0] when this runs as a script

    return advise_all()


if __name__ == "__main__":
    sys.exit(main())
