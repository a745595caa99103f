"""Case 7 — accuracy: the digits classifier trained under fp32 and every preset, per backend.

Data: ``sklearn.datasets.load_digits`` (1,797 8×8 images, pixel values / 16), one fixed split
of 1,347 training and 450 test images. Each preset is trained with the same seeds (weight
init and batch order), so the spread between presets is precision, not luck. The figure is
the mean final test accuracy over the seeds, with its standard deviation and min–max.

- PyTorch: a small CNN (Conv 1→16, Conv 16→32, 3×3, ReLU, max-pool, Linear 512→64→10),
  Adam 3e-3, batch 64, 20 epochs. ``fp32`` is the plain loop; the presets use
  ``mixprec.torch.wrap``.
- MXNet Gluon: the same CNN, hybridized; ``fp32 Trainer`` is ``gluon.Trainer``, the presets
  ``mixprec.mxnet.Trainer``. (The fp16 presets are refused on a CPU context by design.)
- NumPy plugin (``mixprec_numpy``): its layer set has no convolution, so the model is its
  ``MLP([64, 128, 10])`` with SGD (momentum 0.9); ``fp32`` is the plain loop without a
  ``Trainer``. bfloat16 and float16 are emulated there (round-to-nearest-even casts).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from benchmarks.runner import (
    Case,
    Job,
    JobResult,
    Measurement,
    Options,
    error_text,
    log,
    setup_torch,
)

TORCH_PRESETS = ("fp32", "O0", "O1-bf16", "O2-bf16", "O3-bf16", "O1", "O2")
MXNET_PRESETS = ("fp32 Trainer", "O0", "O1-bf16", "O2-bf16")
NUMPY_PRESETS = ("fp32", "O0", "O1", "O2", "O2-bf16")
BASELINE = {"torch": "fp32", "mxnet": "fp32 Trainer", "numpy": "fp32"}
MIXED = {  # the presets the target holds to "within 1 point of fp32"
    "torch": ("O1-bf16", "O2-bf16", "O3-bf16", "O1", "O2"),
    "mxnet": ("O1-bf16", "O2-bf16"),
    "numpy": ("O1", "O2", "O2-bf16"),
}
BATCH = 64
LR = 3e-3
EPOCHS = 20  # the numpy MLP (SGD) gets twice as many


def digits() -> tuple[Any, Any, Any, Any]:
    """Train images, train labels, test images, test labels (float32 in [0, 1], int64)."""
    import numpy as np
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    order = np.random.RandomState(0).permutation(len(x))
    train, test = order[:1347], order[1347:]
    return x[train], y[train], x[test], y[test]


def batches(n: int, seed: int, epoch: int) -> list[Any]:
    import numpy as np

    order = np.random.RandomState(seed * 1000 + epoch).permutation(n)
    return [order[i : i + BATCH] for i in range(0, n, BATCH)]


def _settings(opts: Options) -> tuple[int, int]:
    seeds = opts.seeds if opts.seeds is not None else (1 if opts.quick else 5)
    return seeds, 2 if opts.quick else EPOCHS


def _collect(
    backend: str, presets: tuple[str, ...], opts: Options, train: Callable[[str, int, int], float]
) -> JobResult:
    seeds, epochs = _settings(opts)
    result = JobResult()
    started = time.perf_counter()
    for preset in presets:
        samples: list[float] = []
        error = None
        t0 = time.perf_counter()
        try:
            for seed in range(seeds):
                samples.append(100.0 * train(preset, seed, epochs))
        except Exception as exc:
            error = error_text(exc)
        spent = time.perf_counter() - t0
        failed = f" error: {error}" if error else ""
        log(f"    {backend} / {preset}: {samples} ({spent:.1f} s){failed}")
        result.measurements.append(
            Measurement(
                "accuracy",
                backend,
                preset,
                "test accuracy",
                "%",
                samples,
                error,
                headline="mean",
                note=f"{spent:.0f} s for {len(samples)} seed(s)",
            )
        )
    total = time.perf_counter() - started
    result.lines.append(f"{backend}: {seeds} seed(s) × {epochs} epochs, {total:.0f} s in all")
    return result


# ----------------------------------------------------------------------------- torch


def _torch_cnn(seed: int) -> Any:
    torch = setup_torch()
    nn = torch.nn
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 16, 64), nn.ReLU(), nn.Linear(64, 10),
    )  # fmt: skip


def train_torch(preset: str, seed: int, epochs: int) -> float:
    torch = setup_torch()
    xtr, ytr, xte, yte = digits()
    xtr_t = torch.from_numpy(xtr).reshape(-1, 1, 8, 8)
    ytr_t = torch.from_numpy(ytr)
    xte_t = torch.from_numpy(xte).reshape(-1, 1, 8, 8)
    model = _torch_cnn(seed)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    ce = torch.nn.functional.cross_entropy
    if preset == "fp32":
        for epoch in range(epochs):
            for idx in batches(len(xtr), seed, epoch):
                opt.zero_grad(set_to_none=True)
                ce(model(xtr_t[idx]), ytr_t[idx]).backward()
                opt.step()
    else:
        import mixprec

        model, opt = mixprec.torch.wrap(model, opt, policy=preset)
        for epoch in range(epochs):
            for idx in batches(len(xtr), seed, epoch):
                opt.zero_grad(set_to_none=True)
                loss = ce(model(xtr_t[idx]).float(), ytr_t[idx])
                with mixprec.torch.scale_loss(loss, opt) as scaled:
                    scaled.backward()
                opt.step()
    model.eval()
    with torch.no_grad():
        pred = model(xte_t).float().argmax(dim=1).numpy()
    return float((pred == yte).mean())


def run_torch(opts: Options) -> JobResult:
    return _collect("torch", TORCH_PRESETS, opts, train_torch)


# ----------------------------------------------------------------------------- mxnet


def mxnet_cnn(seed: int) -> Any:
    """The digits CNN in Gluon (Xavier init from ``seed``), hybridized."""
    import mxnet as mx
    from mxnet import gluon

    mx.random.seed(seed)
    nn = gluon.nn
    net = nn.HybridSequential()
    net.add(
        nn.Conv2D(16, 3, padding=1, activation="relu"),
        nn.Conv2D(32, 3, padding=1, activation="relu"),
        nn.MaxPool2D(2),
        nn.Flatten(),
        nn.Dense(64, activation="relu"),
        nn.Dense(10),
    )
    net.initialize(mx.init.Xavier(), ctx=mx.cpu())
    net.hybridize(static_alloc=True)
    return net


def train_mxnet(preset: str, seed: int, epochs: int) -> float:
    import mxnet as mx
    import numpy as np
    from mxnet import autograd, gluon

    xtr, ytr, xte, yte = digits()
    net = mxnet_cnn(seed)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    x_all = mx.nd.array(xtr.reshape(-1, 1, 8, 8))
    y_all = mx.nd.array(ytr.astype(np.float32))
    if preset == "fp32 Trainer":
        trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": LR})
    else:
        import mixprec

        trainer = mixprec.mxnet.Trainer(net, "adam", {"learning_rate": LR}, policy=preset)
    for epoch in range(epochs):
        for idx in batches(len(xtr), seed, epoch):
            sel = mx.nd.array(idx, dtype="int64")
            x, y = x_all.take(sel), y_all.take(sel)
            with autograd.record():
                loss = loss_fn(net(x), y)
                if preset == "fp32 Trainer":
                    loss.backward()
                else:
                    with trainer.scale_loss(loss) as scaled:
                        autograd.backward(scaled)
            trainer.step(len(idx))
    out = net(mx.nd.array(xte.reshape(-1, 1, 8, 8)))
    pred = out.astype("float32").asnumpy().argmax(axis=1)
    return float((pred == yte).mean())


def run_mxnet(opts: Options) -> JobResult:
    return _collect("mxnet", MXNET_PRESETS, opts, train_mxnet)


# ----------------------------------------------------------------------------- numpy plugin


def numpy_step(model: Any, opt: Any, trainer: Any, x: Any, y: Any) -> None:
    """One NumPy-plugin training step: the plain loop when ``trainer`` is None (fp32),
    else the plugin's Trainer."""
    model.loss(x, y)
    if trainer is None:
        model.backward()
        params = model.parameters()
        opt.update(params)
        for p in params:
            p.grad = None
    else:
        trainer.backward()
        trainer.step()


def train_numpy(preset: str, seed: int, epochs: int) -> float:
    import mixprec_numpy as mpn

    xtr, ytr, xte, yte = digits()
    model = mpn.MLP([64, 128, 10], seed=seed)
    opt = mpn.SGD(lr=0.1, momentum=0.9)
    trainer = None if preset == "fp32" else mpn.Trainer(model, opt, policy=preset)
    for epoch in range(epochs * 2):  # SGD on an MLP: twice the epochs of the Adam CNNs
        for idx in batches(len(xtr), seed, epoch):
            numpy_step(model, opt, trainer, xtr[idx], ytr[idx])
    pred = model.predict(xte).argmax(axis=1)
    return float((pred == yte).mean())


def run_numpy(opts: Options) -> JobResult:
    return _collect("numpy", NUMPY_PRESETS, opts, train_numpy)


def jobs(opts: Options) -> list[Job]:
    return [
        Job("accuracy torch", "benchmarks.accuracy:run_torch", {}, "torch"),
        Job("accuracy mxnet", "benchmarks.accuracy:run_mxnet", {}, "mxnet"),
        Job("accuracy numpy", "benchmarks.accuracy:run_numpy", {}, "numpy"),
    ]


CASE = Case(
    name="accuracy",
    title="Accuracy: digits (sklearn load_digits) under fp32 and every preset, per backend",
    jobs=jobs,
    groups={
        "torch": "CNN (Conv 16, Conv 32, pool, Linear 64, Linear 10), Adam 3e-3, batch 64, "
        "20 epochs",
        "mxnet": "the same CNN in Gluon, hybridized, Adam 3e-3, batch 64, 20 epochs",
        "numpy": "mixprec_numpy.MLP([64, 128, 10]) (no conv layer there), SGD 0.1 m0.9, 40 epochs",
    },
    order=("fp32", "fp32 Trainer", "O0", "O1-bf16", "O2-bf16", "O3-bf16", "O1", "O2"),
    differences=("fp32", "fp32 Trainer"),
    method=(
        "Fixed split (1,347 train / 450 test). For each seed: init and batch order from the "
        "seed, train, then test accuracy of the final weights. Mean ± standard deviation and "
        "min–max over the seeds; Δ is the difference of means to the fp32 loop of the same "
        "backend, in points."
    ),
)
