"""Case 9b — compensated bfloat16 weights on MXNet Gluon (case ``compensated_gluon``).

The tasks of :mod:`benchmarks.compensated` in Gluon, under the same five policies (``fp32``
is a plain ``gluon.Trainer``, the others ``mixprec.mxnet.Trainer``): the teacher-student
regression (same data, student shape, init scheme, Adam, batch order and loss as the torch
group) and case 7's digits CNN. A case of its own so that it can be run without re-running
the torch and numpy groups: on this AVX2-only machine Gluon's bfloat16 convolutions and
matmuls run as float32 islands with casts around them, so a bfloat16 digits epoch takes
seconds where a float32 one takes a fraction of one, and the digits group trains
:data:`DIGITS_EPOCHS` epochs, not the torch group's 10.

Accuracy only, as case 9: no timing from this machine means anything for bfloat16.
"""

from __future__ import annotations

from typing import Any

from benchmarks.compensated import (
    ACCURACY,
    BATCH,
    DIGITS_LR,
    HIDDEN,
    LR,
    MSE,
    STEPS,
    TORCH_PRESETS,
    WIDTH,
    _collect,
    _data,
)
from benchmarks.runner import Case, Job, JobResult, Options

#: Digits epochs on Gluon (bfloat16 epochs are slow here, see above); enough for ~94 %.
DIGITS_EPOCHS = 3


def _gluon_trainer(net: Any, preset: str, lr: float, seed: int) -> tuple[Any, bool]:
    """(trainer, whether it is mixprec's): ``fp32`` is a plain ``gluon.Trainer``."""
    from mxnet import gluon

    if preset == "fp32":
        return gluon.Trainer(net.collect_params(), "adam", {"learning_rate": lr}), False
    import mixprec

    trainer = mixprec.mxnet.Trainer(net, "adam", {"learning_rate": lr}, policy=preset, seed=seed)
    return trainer, True


def train_gluon(preset: str, seed: int, steps: int) -> float:
    """The torch task in Gluon: the same data, student shape (initialised like
    ``torch.nn.Linear``: uniform in ±1/sqrt(fan-in), from the seed), Adam, batch order and
    loss; the final test MSE."""
    import mxnet as mx
    import numpy as np
    from mxnet import autograd, gluon

    xtr, ytr, xte, yte = (mx.nd.array(a) for a in _data(seed))
    mx.random.seed(seed)
    net = gluon.nn.HybridSequential()
    for units, fan_in, act in ((HIDDEN, WIDTH, "tanh"), (1, HIDDEN, None)):
        init = mx.init.Uniform(1.0 / np.sqrt(fan_in))
        net.add(
            gluon.nn.Dense(units, in_units=fan_in, activation=act, weight_initializer=init,
                           bias_initializer=init)
        )  # fmt: skip
    net.initialize()
    net.hybridize()
    trainer, _ = _gluon_trainer(net, preset, LR, seed)
    order = np.random.RandomState(seed)
    for _ in range(steps):
        idx = mx.nd.array(order.randint(0, xtr.shape[0], BATCH), dtype="int64")
        x, y = xtr.take(idx), ytr.take(idx)
        with autograd.record():
            loss = ((net(x).astype("float32") - y) ** 2).mean(axis=1)
        loss.backward()  # bf16 needs no loss scale, and no preset here has one
        trainer.step(BATCH)
    return float(((net(xte).astype("float32") - yte) ** 2).mean().asscalar())


def train_gluon_digits(preset: str, seed: int, epochs: int) -> float:
    """Test accuracy (0–1) of case 7's digits CNN in Gluon (Adam 3e-3, batch 64) under
    ``preset``, with the seed's init and batch order."""
    import mxnet as mx
    import numpy as np
    from mxnet import autograd, gluon

    from benchmarks.accuracy import batches, digits, mxnet_cnn

    xtr, ytr, xte, yte = digits()
    net = mxnet_cnn(seed)
    trainer, _ = _gluon_trainer(net, preset, DIGITS_LR, seed)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    x_all = mx.nd.array(xtr.reshape(-1, 1, 8, 8))
    y_all = mx.nd.array(ytr.astype(np.float32))
    for epoch in range(epochs):
        for idx in batches(len(xtr), seed, epoch):
            sel = mx.nd.array(idx, dtype="int64")
            with autograd.record():
                loss = loss_fn(net(x_all.take(sel)).astype("float32"), y_all.take(sel))
            loss.backward()
            trainer.step(len(idx))
    out = net(mx.nd.array(xte.reshape(-1, 1, 8, 8)))
    pred = out.astype("float32").asnumpy().argmax(axis=1)
    return float((pred == yte).mean())


def run_gluon(opts: Options) -> JobResult:
    return _collect("gluon", opts, train_gluon, (STEPS, STEPS // 10, "steps"), MSE)


def run_gluon_digits(opts: Options) -> JobResult:
    return _collect(
        "gluon digits", opts, train_gluon_digits, (DIGITS_EPOCHS, 1, "epochs"), ACCURACY
    )


def jobs(opts: Options) -> list[Job]:
    return [
        Job("compensated gluon", "benchmarks.compensated_gluon:run_gluon", {}, "gluon"),
        Job(
            "compensated gluon digits",
            "benchmarks.compensated_gluon:run_gluon_digits",
            {},
            "gluon digits",
        ),
    ]


CASE = Case(
    name="compensated_gluon",
    title="Compensated bfloat16 weights on MXNet Gluon (accuracy only)",
    jobs=jobs,
    groups={
        "gluon": f"case 9's teacher-student task in Gluon (fp32: gluon.Trainer), Adam {LR:g}, "
        f"batch {BATCH}, {STEPS} steps; test MSE ×1e3",
        "gluon digits": f"case 7's digits CNN in Gluon, Adam {DIGITS_LR:g}, batch 64, "
        f"{DIGITS_EPOCHS} epochs; test accuracy",
    },
    order=TORCH_PRESETS,
    differences=("fp32",),
    method=(
        "As case 9 (compensated): per seed, data, init and batch order from the seed; the "
        "test MSE ×1,000 of the final weights (lower is better) or the digits test accuracy "
        "(higher is better). Mean ± standard deviation over the seeds; Δ to fp32. No timing."
    ),
)
