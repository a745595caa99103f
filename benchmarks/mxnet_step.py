"""Case 2 — MXNet Gluon training step on the CPU in bfloat16.

Two hybridized Gluon models: a CNN (3 × Conv 3×3 + BatchNorm + ReLU + max-pool, 64/128/256
channels, then Dense 256 and Dense 10; batch 128 of 3×32×32) and an MLP (4 × Dense 2048 +
GELU, batch 256). Contenders:

- ``fp32 Trainer``: ``gluon.Trainer`` and the plain loop.
- ``mxnet.contrib.amp bf16``: the documented AMP training recipe —
  ``amp.init(target_dtype="bfloat16")`` before the model is built, ``amp.init_trainer(trainer)``,
  ``with amp.scale_loss(loss, trainer) as scaled: autograd.backward(scaled)``. ``amp.init``
  monkey-patches ``mx.nd``/``mx.sym`` for the whole process, so this contender runs in a
  process of its own.
- ``mixprec O1-bf16``, ``mixprec O2-bf16``: ``mixprec.mxnet.Trainer(net, "adam", ...)`` and
  ``trainer.scale_loss``.

Every contender uses Adam (learning rate 1e-4) and ends its sample with ``mx.nd.waitall()``
so that MXNet's asynchronous engine has finished the step before the clock stops.

``python -m benchmarks.mxnet_step`` (run it pinned: ``OMP_NUM_THREADS=1
MXNET_CPU_WORKER_NTHREADS=1 taskset -c 1``) times the in-process contenders in *CPU time*
(``time.process_time``), round robin, and prints each one's median and the median of its
per-round ratios to the fp32 Trainer: on a machine shared with other jobs the CPU time of a
pinned single-threaded step moves far less than its wall time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.runner import Case, Factory, Job, JobResult, Options, compare, log

MODELS = {
    "cnn": "3 × (Conv 3×3 + BatchNorm + ReLU + MaxPool) 64/128/256 ch, Dense 256, Dense 10; "
    "batch 128 × 3×32×32",
    "mlp": "4 × (Dense 2048 + GELU), batch 256, softmax cross-entropy over 2048 classes",
}
AMP = "mxnet.contrib.amp bf16"
IN_PROCESS = ("fp32 Trainer", "mixprec O1-bf16", "mixprec O2-bf16")
OPT_PARAMS = {"learning_rate": 1e-4}


def build(kind: str, seed: int = 0) -> tuple[Any, Any, Any, int]:
    """A hybridized, initialised net for ``kind``, one batch, its labels and the batch size."""
    import mxnet as mx
    from mxnet import gluon

    mx.random.seed(seed)
    nn = gluon.nn
    net = nn.HybridSequential()
    if kind == "cnn":
        for channels in (64, 128, 256):
            net.add(nn.Conv2D(channels, 3, padding=1), nn.BatchNorm(), nn.Activation("relu"))
            net.add(nn.MaxPool2D(2))
        net.add(nn.Flatten(), nn.Dense(256, activation="relu"), nn.Dense(10))
        batch, x = 128, mx.nd.random.normal(shape=(128, 3, 32, 32))
        y = mx.nd.random.randint(0, 10, shape=(128,)).astype("float32")
    elif kind == "mlp":
        for _ in range(4):
            net.add(nn.Dense(2048), nn.GELU())
        batch, x = 256, mx.nd.random.normal(shape=(256, 2048))
        y = mx.nd.random.randint(0, 2048, shape=(256,)).astype("float32")
    elif kind == "tiny":  # for the op-count test: Dense 8 -> 16 -> 4
        net.add(nn.Dense(16, in_units=8, activation="relu"), nn.Dense(4, in_units=16))
        batch, x = 8, mx.nd.random.normal(shape=(8, 8))
        y = mx.nd.random.randint(0, 4, shape=(8,)).astype("float32")
    else:
        raise ValueError(f"unknown model {kind!r}")
    net.initialize(mx.init.Xavier(), ctx=mx.cpu())
    net.hybridize(static_alloc=True, static_shape=True)
    return net, x, y, batch


def make_step(contender: str, kind: str) -> Callable[[], None]:
    """Set up one contender on a fresh ``kind`` model and return its training step."""
    import mxnet as mx
    from mxnet import autograd, gluon

    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    if contender == AMP:
        from mxnet.contrib import amp

        amp.init(target_dtype="bfloat16")  # before the model is built, as documented
        net, x, y, batch = build(kind)
        trainer = gluon.Trainer(net.collect_params(), "adam", dict(OPT_PARAMS))
        amp.init_trainer(trainer)

        def step() -> None:
            with autograd.record():
                loss = loss_fn(net(x), y)
                with amp.scale_loss(loss, trainer) as scaled:
                    autograd.backward(scaled)
            trainer.step(batch)
            mx.nd.waitall()

    elif contender == "fp32 Trainer":
        net, x, y, batch = build(kind)
        trainer = gluon.Trainer(net.collect_params(), "adam", dict(OPT_PARAMS))

        def step() -> None:
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            trainer.step(batch)
            mx.nd.waitall()

    elif contender.startswith("mixprec "):
        import mixprec

        net, x, y, batch = build(kind)
        policy = contender.split(" ", 1)[1]
        trainer = mixprec.mxnet.Trainer(net, "adam", dict(OPT_PARAMS), policy=policy)

        def step() -> None:
            with autograd.record():
                loss = loss_fn(net(x), y)
                with trainer.scale_loss(loss) as scaled:
                    autograd.backward(scaled)
            trainer.step(batch)
            mx.nd.waitall()

    else:
        raise ValueError(f"unknown contender {contender!r}")
    return step


def factory(contender: str, kind: str) -> Factory:
    def setup() -> Callable[[], None]:
        return make_step(contender, kind)

    return setup


def run(opts: Options, contenders: list[str]) -> JobResult:
    """Worker: the given contenders on both models (round-robin within each model)."""
    result = JobResult()
    for kind in MODELS:
        log(f"  mxnet_step / {kind}: {', '.join(contenders)}")
        result.measurements += compare(
            "mxnet_step",
            kind,
            {name: factory(name, kind) for name in contenders},
            warmup=opts.warm(3, 1),
            repeat=opts.reps(15, 3),
        )
    import mxnet as mx

    result.meta["mxnet_features"] = [f.name for f in mx.runtime.Features().values() if f.enabled]
    return result


def jobs(opts: Options) -> list[Job]:
    return [
        Job(
            "mxnet_step fp32+mixprec", "benchmarks.mxnet_step:run", {"contenders": list(IN_PROCESS)}
        ),
        Job("mxnet_step amp", "benchmarks.mxnet_step:run", {"contenders": [AMP]}),
    ]


CASE = Case(
    name="mxnet_step",
    title="MXNet Gluon, CPU bfloat16, one training step",
    jobs=jobs,
    baselines=("fp32 Trainer", AMP),
    groups=MODELS,
    order=("fp32 Trainer", AMP, *IN_PROCESS[1:]),
    method=(
        "One sample = forward and loss under autograd.record, (scaled) backward, trainer.step, "
        "then mx.nd.waitall(). fp32 and the mixprec contenders run round-robin in one process; "
        "mxnet.contrib.amp runs in a second process right after (amp.init patches MXNet "
        "globally), so its ratios compare medians from two processes of the same run."
    ),
)


def cpu_time_ratios(kinds: list[str], contenders: list[str], reps: int) -> list[str]:
    """Lines: each contender's median CPU time per step and ratio to the first contender."""
    import statistics
    import time

    lines = []
    for kind in kinds:
        steps = {name: make_step(name, kind) for name in contenders}
        for step in steps.values():
            for _ in range(3):
                step()
        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(reps):
            for name, step in steps.items():
                start = time.process_time()
                step()
                times[name].append(time.process_time() - start)
        base = times[contenders[0]]
        for name, ts in times.items():
            ratio = statistics.median(a / b for a, b in zip(ts, base, strict=True))
            lines.append(
                f"{kind}  {name:<18} {statistics.median(ts) * 1e3:7.1f} ms CPU (median of "
                f"{reps}, min {min(ts) * 1e3:.1f})  {ratio:.3f}x {contenders[0]}"
            )
    return lines


def _mixprec_trainer(kind: str, optimizer: str, policy: str) -> tuple[Any, Callable[[], None]]:
    """A mixprec Trainer on a fresh ``kind`` model and its forward + backward (no step)."""
    import mxnet as mx
    from mxnet import autograd, gluon

    import mixprec

    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    net, x, y, batch = build(kind)
    params = dict(OPT_PARAMS, momentum=0.9) if optimizer == "sgd" else dict(OPT_PARAMS)
    trainer = mixprec.mxnet.Trainer(net, optimizer, params, policy=policy)

    def backward() -> None:
        with autograd.record():
            loss = loss_fn(net(x), y)
            with trainer.scale_loss(loss) as scaled:
                autograd.backward(scaled)
        mx.nd.waitall()

    trainer.batch = batch
    return trainer, backward


def _switch(multi: bool) -> None:
    import os

    from mixprec_mxnet.step.multi_tensor import ENV

    os.environ[ENV] = "1" if multi else "0"


def ops_per_step(kind: str, optimizer: str, multi: bool, policy: str = "O2-bf16") -> dict[str, int]:
    """The MXNet ops one ``trainer.step()`` runs (MXNet's profiler, aggregate counts by op
    name), on the multi-tensor path or the per-parameter one."""
    import json
    import os
    import tempfile

    import mxnet as mx

    _switch(multi)
    trainer, backward = _mixprec_trainer(kind, optimizer, policy)
    for _ in range(2):  # optimizer state made, kvstore and caches settled
        backward()
        trainer.step(trainer.batch)
    backward()
    with tempfile.TemporaryDirectory() as tmp:
        mx.profiler.set_config(
            profile_imperative=True,
            aggregate_stats=True,
            filename=os.path.join(tmp, "profile.json"),
        )
        mx.profiler.dumps(reset=True)
        mx.profiler.set_state("run")
        trainer.step(trainer.batch)
        mx.nd.waitall()
        mx.profiler.set_state("stop")
        stats = json.loads(mx.profiler.dumps(reset=True, format="json"))
    ops = stats.get("Time", {}).get("operator", {})
    engine = {"DeleteVariable", "WaitForVar"}  # the engine's bookkeeping, not ops
    return {name: int(row["Count"]) for name, row in ops.items() if name not in engine}


def python_calls_per_step(kind: str, optimizer: str, multi: bool) -> int:
    """Python function calls (``sys.setprofile`` call events) in one ``trainer.step()``."""
    import sys

    import mxnet as mx

    _switch(multi)
    trainer, backward = _mixprec_trainer(kind, optimizer, "O2-bf16")
    for _ in range(2):
        backward()
        trainer.step(trainer.batch)
    backward()
    calls = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        trainer.step(trainer.batch)
    finally:
        sys.setprofile(None)
    mx.nd.waitall()
    return calls


def step_cpu_time(kind: str, optimizer: str, multi: bool, policy: str, reps: int) -> float:
    """Median CPU time of ``trainer.step()`` alone (the update part: casts, the overflow
    check, the optimizer, the write-back), after a forward and backward not timed."""
    import statistics
    import time

    import mxnet as mx

    _switch(multi)
    trainer, backward = _mixprec_trainer(kind, optimizer, policy)
    times = []
    for i in range(reps + 2):
        backward()
        start = time.process_time()
        trainer.step(trainer.batch)
        mx.nd.waitall()
        if i >= 2:
            times.append(time.process_time() - start)
    return statistics.median(times)


def ops_report(kinds: list[str], optimizers: list[str], reps: int) -> list[str]:
    """Lines: MXNet ops and Python calls per ``trainer.step()``, per-parameter path vs
    multi-tensor path, and the step's CPU time under O2-bf16 and O0 (float32 weights)."""
    lines = []
    for kind in kinds:
        for optimizer in optimizers:
            before = ops_per_step(kind, optimizer, multi=False)
            after = ops_per_step(kind, optimizer, multi=True)
            calls = [python_calls_per_step(kind, optimizer, m) for m in (False, True)]
            lines.append(
                f"{kind} {optimizer:<6} ops/step {sum(before.values()):4d} -> "
                f"{sum(after.values()):4d}   python calls/step {calls[0]:6d} -> {calls[1]:6d}"
            )
            lines.append(f"    before: {dict(sorted(before.items()))}")
            lines.append(f"    after:  {dict(sorted(after.items()))}")
            for policy in ("O2-bf16", "O0"):
                t = [step_cpu_time(kind, optimizer, m, policy, reps) for m in (False, True)]
                lines.append(
                    f"    trainer.step() CPU time, {policy}: {t[0] * 1e3:.2f} -> "
                    f"{t[1] * 1e3:.2f} ms ({t[1] / t[0]:.2f}x)"
                )
    return lines


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Gluon step CPU time, round robin")
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument(
        "--ops",
        action="store_true",
        help="MXNet ops and Python calls per trainer.step(), per-parameter vs multi-tensor "
        "path (MIXPREC_MXNET_MULTI_TENSOR=0/1), and trainer.step()'s CPU time",
    )
    parser.add_argument("--optimizers", default="adam,adamw,sgd")
    args = parser.parse_args()
    if args.ops:
        for line in ops_report(args.models.split(","), args.optimizers.split(","), args.reps):
            print(line, flush=True)
    else:
        for line in cpu_time_ratios(args.models.split(","), list(IN_PROCESS), args.reps):
            print(line)
