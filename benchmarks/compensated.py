"""Case 9 — compensated bfloat16 weights: a task where O3-bf16 loses to fp32, and the fix.

A student MLP (16 → 32 → 1, tanh) learns a fixed random teacher of the same shape by
regression (MSE) with Adam at a small learning rate (3e-4) for 1,000 steps. Adam's update is
about the learning rate, far below half the bfloat16 spacing of weights near 0.2–0.5 (2**-9
to 2**-8), so O3-bf16 rounds most updates away and barely learns, while fp32, O2-bf16
(float32 masters) and the compensated presets ``O3-bf16-kahan`` and ``O3-bf16-sr`` keep
them; on torch both also run with ``state=bfloat16`` (Adam's moments kept in bfloat16
between steps, rounded stochastically). The figure is the final test MSE (lower is better),
mean ± sd over seeds, per backend; the NumPy plugin runs its own reference arithmetic (SGD,
as its optimizer). The digits CNN of case 7 (``benchmarks.accuracy``) runs under the same
policies for a few epochs (test accuracy, higher is better): a task where plain bfloat16
weights are expected to hold; on the NumPy plugin, which has no convolution, case 7's digits
MLP (SGD with momentum, so ``state=bfloat16`` has a buffer to round) stands in for it.
:mod:`benchmarks.compensated_gluon` (case ``compensated_gluon``) runs both tasks on Gluon.
``benchmarks/compensated_plot.py`` draws the teacher-student loss curves (docs/img/).

Accuracy only: on a CPU without AVX512-BF16 (this machine) bfloat16 matmuls are far slower
than float32, so no timing from this case means anything and none is reported.
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
)

TORCH_PRESETS = (
    "fp32",
    "O2-bf16",
    "O3-bf16",
    "O3-bf16-kahan",
    "O3-bf16-sr",
    "O3-bf16-kahan,state=bfloat16",
    "O3-bf16-sr,state=bfloat16",
)
# the NumPy task's SGD has no momentum, so it keeps no state for state=bfloat16 to round
NUMPY_PRESETS = ("fp32", "O2-bf16", "O3-bf16", "O3-bf16-kahan", "O3-bf16-sr")
# the NumPy digits MLP trains with momentum, whose buffer state=bfloat16 rounds
NUMPY_DIGITS_PRESETS = TORCH_PRESETS
WIDTH, HIDDEN, BATCH = 16, 32, 64
STEPS, LR = 1000, 3e-4
NUMPY_STEPS, NUMPY_LR = 1000, 2e-3
# bf16 convolutions are slower than fp32 on an AVX2-only CPU, but this CNN is small (~0.6 s
# an epoch in bf16 here): 10 epochs keep the job to about 2 minutes for 5 presets x 5 seeds
# and take the CNN to ~98 % (case 7 trains 20)
DIGITS_EPOCHS = 10
DIGITS_LR = 3e-3
# case 7's NumPy digits model (no convolution there): an MLP with SGD, momentum 0.9
NUMPY_DIGITS_EPOCHS, NUMPY_DIGITS_LR = 20, 0.1
CURVE_EVERY = 25  # steps between two points of a loss curve
# (metric, unit, factor) of each group's figure
MSE = ("test MSE ×1e3", "", 1000.0)
CE = ("test cross-entropy ×1e3", "", 1000.0)
ACCURACY = ("test accuracy", "%", 100.0)


def _torch() -> Any:
    """torch on one thread, whatever ``--threads`` says: these tensors are too small to share
    out, and on a busy 2-core machine two OpenMP threads made a 1 s run take 30 s (each
    parallel region waits for a descheduled thread). Accuracy does not depend on it."""
    import torch

    torch.set_num_threads(1)
    return torch


def _seeds(opts: Options) -> int:
    return opts.seeds if opts.seeds is not None else (1 if opts.quick else 5)


def _data(seed: int) -> tuple[Any, Any, Any, Any]:
    """Train and test inputs and teacher targets (float32 NumPy arrays)."""
    import numpy as np

    rng = np.random.RandomState(1000 + seed)
    w1 = rng.randn(WIDTH, HIDDEN).astype(np.float32) / np.sqrt(WIDTH)
    w2 = rng.randn(HIDDEN, 1).astype(np.float32) / np.sqrt(HIDDEN)

    def teacher(x: Any) -> Any:
        return (np.tanh(x @ w1) @ w2).astype(np.float32)

    xtr = rng.randn(4096, WIDTH).astype(np.float32)
    xte = rng.randn(1024, WIDTH).astype(np.float32)
    return xtr, teacher(xtr), xte, teacher(xte)


def _collect(
    group: str,
    opts: Options,
    train: Callable[[str, int, int], float],
    length: tuple[int, int, str],
    metric: tuple[str, str, float],
    presets: tuple[str, ...] = TORCH_PRESETS,
) -> JobResult:
    """Train every preset over the seeds. ``length``: (full, quick, unit) of the run's length
    (steps or epochs); ``metric``: (name, unit, factor applied to ``train``'s figure)."""
    seeds = _seeds(opts)
    steps = length[1] if opts.quick else length[0]
    name, unit, factor = metric
    result = JobResult()
    for preset in presets:
        samples: list[float] = []
        error = None
        t0 = time.perf_counter()
        try:
            for seed in range(seeds):
                samples.append(factor * train(preset, seed, steps))
        except Exception as exc:
            error = error_text(exc)
        spent = time.perf_counter() - t0
        log(f"    {group} / {preset}: {samples} ({spent:.1f} s){' ' + error if error else ''}")
        result.measurements.append(
            Measurement(
                "compensated",
                group,
                preset,
                name,
                unit,
                samples,
                error,
                headline="mean",
                note=f"{spent:.0f} s for {len(samples)} seed(s)",
            )
        )
    result.lines.append(f"{group}: {seeds} seed(s) × {steps} {length[2]}")
    return result


def train_torch(preset: str, seed: int, steps: int, curve: list[float] | None = None) -> float:
    """Final test MSE of the student trained under ``preset`` (``fp32``: no mixprec); with
    ``curve``, the test MSE every ``CURVE_EVERY`` steps is appended to it."""
    import numpy as np

    torch = _torch()
    xtr, ytr, xte, yte = (torch.from_numpy(a) for a in _data(seed))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1)
    )
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    if preset != "fp32":
        import mixprec

        model, opt = mixprec.torch.wrap(model, opt, policy=preset, seed=seed)
    order = np.random.RandomState(seed)

    def test_mse() -> float:
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(model(xte).float(), yte))

    for step in range(steps):
        idx = torch.from_numpy(order.randint(0, len(xtr), BATCH))
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xtr[idx]).float(), ytr[idx])
        loss.backward()
        opt.step()
        if curve is not None and (step + 1) % CURVE_EVERY == 0:
            curve.append(test_mse())
    return test_mse()


def train_numpy(preset: str, seed: int, steps: int) -> float:
    """The same task on the NumPy plugin's reference arithmetic: its MLP and SGD have no
    tanh and no Adam, so a ReLU student learns the teacher's sign (2 classes) instead; the
    figure is the test cross-entropy."""
    import numpy as np

    import mixprec_numpy as mpn
    from benchmarks.accuracy import numpy_step

    xtr, ytr, xte, yte = _data(seed)
    labels_tr, labels_te = (ytr[:, 0] > 0).astype(np.int64), (yte[:, 0] > 0).astype(np.int64)
    model = mpn.MLP([WIDTH, HIDDEN, 2], seed=seed)
    opt = mpn.SGD(lr=NUMPY_LR, momentum=0.0)
    trainer = None if preset == "fp32" else mpn.Trainer(model, opt, policy=preset, seed=seed)
    order = np.random.RandomState(seed)
    for _ in range(steps):
        idx = order.randint(0, len(xtr), BATCH)
        numpy_step(model, opt, trainer, xtr[idx], labels_tr[idx])
    return float(model.loss(xte, labels_te))


def train_digits(preset: str, seed: int, epochs: int) -> float:
    """Test accuracy (0–1) of case 7's digits CNN (Adam 3e-3, batch 64) under ``preset``,
    with the seed's init and batch order; the stochastic rounding stream is seeded too."""
    from benchmarks.accuracy import _torch_cnn, batches, digits

    torch = _torch()
    xtr, ytr, xte, yte = digits()
    xtr_t, ytr_t = torch.from_numpy(xtr).reshape(-1, 1, 8, 8), torch.from_numpy(ytr)
    xte_t = torch.from_numpy(xte).reshape(-1, 1, 8, 8)
    model = _torch_cnn(seed)
    opt = torch.optim.Adam(model.parameters(), lr=DIGITS_LR)
    if preset != "fp32":
        import mixprec

        model, opt = mixprec.torch.wrap(model, opt, policy=preset, seed=seed)
    for epoch in range(epochs):
        for idx in batches(len(xtr), seed, epoch):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xtr_t[idx]).float(), ytr_t[idx])
            loss.backward()  # bf16 needs no loss scale, and no preset here has one
            opt.step()
    model.eval()
    with torch.no_grad():
        pred = model(xte_t).float().argmax(dim=1).numpy()
    return float((pred == yte).mean())


def train_digits_numpy(preset: str, seed: int, epochs: int) -> float:
    """Test accuracy (0–1) of case 7's NumPy digits MLP (SGD 0.1, momentum 0.9, batch 64)
    under ``preset``, with the seed's init, batch order and stochastic rounding stream."""
    import mixprec_numpy as mpn
    from benchmarks.accuracy import batches, digits, numpy_step

    xtr, ytr, xte, yte = digits()
    model = mpn.MLP([64, 128, 10], seed=seed)
    opt = mpn.SGD(lr=NUMPY_DIGITS_LR, momentum=0.9)
    trainer = None if preset == "fp32" else mpn.Trainer(model, opt, policy=preset, seed=seed)
    for epoch in range(epochs):
        for idx in batches(len(xtr), seed, epoch):
            numpy_step(model, opt, trainer, xtr[idx], ytr[idx])
    return float((model.predict(xte).argmax(axis=1) == yte).mean())


def run_torch(opts: Options) -> JobResult:
    return _collect("torch", opts, train_torch, (STEPS, STEPS // 10, "steps"), MSE)


def run_numpy(opts: Options) -> JobResult:
    return _collect(
        "numpy", opts, train_numpy, (NUMPY_STEPS, NUMPY_STEPS // 10, "steps"), CE, NUMPY_PRESETS
    )


def run_digits(opts: Options) -> JobResult:
    return _collect("digits", opts, train_digits, (DIGITS_EPOCHS, 1, "epochs"), ACCURACY)


def run_digits_numpy(opts: Options) -> JobResult:
    return _collect(
        "digits numpy",
        opts,
        train_digits_numpy,
        (NUMPY_DIGITS_EPOCHS, 1, "epochs"),
        ACCURACY,
        NUMPY_DIGITS_PRESETS,
    )


def jobs(opts: Options) -> list[Job]:
    return [
        Job("compensated torch", "benchmarks.compensated:run_torch", {}, "torch"),
        Job("compensated numpy", "benchmarks.compensated:run_numpy", {}, "numpy"),
        Job("compensated digits", "benchmarks.compensated:run_digits", {}, "digits"),
        Job(
            "compensated digits numpy",
            "benchmarks.compensated:run_digits_numpy",
            {},
            "digits numpy",
        ),
    ]


CASE = Case(
    name="compensated",
    title="Compensated bfloat16 weights: small updates over a long run (accuracy only)",
    jobs=jobs,
    groups={
        "torch": f"student MLP {WIDTH}→{HIDDEN}→1 (tanh) regressing a random teacher, Adam "
        f"{LR:g}, batch {BATCH}, {STEPS} steps; test MSE ×1e3",
        "numpy": f"mixprec_numpy.MLP([{WIDTH}, {HIDDEN}, 2]) on the teacher's sign, SGD "
        f"{NUMPY_LR:g}, batch {BATCH}, {NUMPY_STEPS} steps; test cross-entropy ×1e3",
        "digits": f"case 7's digits CNN on torch, Adam {DIGITS_LR:g}, batch 64, "
        f"{DIGITS_EPOCHS} epochs; test accuracy",
        "digits numpy": "case 7's NumPy digits model, mixprec_numpy.MLP([64, 128, 10]) (the "
        f"plugin has no convolution), SGD {NUMPY_DIGITS_LR:g} momentum 0.9, batch 64, "
        f"{NUMPY_DIGITS_EPOCHS} epochs; test accuracy",
    },
    order=TORCH_PRESETS,
    differences=("fp32",),
    method=(
        "For each seed: teacher, data, init and batch order from the seed; train, then the "
        "loss of the final weights on 1,024 held-out inputs, times 1,000 (lower is better); "
        "digits: init and batch order from the seed, accuracy on the 450 test images (higher "
        "is better). Mean ± standard deviation over the seeds; Δ is the difference of means "
        "to fp32. "
        "No timing: bfloat16 matmuls are emulated slowly on CPUs without AVX512-BF16."
    ),
)
