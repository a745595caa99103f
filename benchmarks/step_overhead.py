"""Case 3 — step overhead: what loss scaling adds to ``optimizer.step()`` on many small tensors.

The model is 150 × Linear(32, 32) with ReLU between them: 300 small float32 parameter tensors
(weights and biases), batch 8, SGD with momentum. Parameters stay float32 in every contender,
so each optimizer computes the same update, bit for bit, and only the scaling machinery and
the implementation of the update differ: the SGD is built with ``foreach`` and ``fused`` left
to torch, which on the CPU runs its per-tensor for-loop, and a wrapped optimizer runs torch's
foreach SGD instead, whose CPU ops are the for-loop's own (``mixprec_torch.step.master_update``;
the same bits in about 30 % less time on these 300 tensors):

- ``plain step``: fp32 forward/backward, then ``opt.step()``.
- ``GradScaler``: ``torch.autocast("cpu", float16)`` forward, ``scaler.scale(loss).backward()``,
  then ``scaler.step(opt); scaler.update()`` — ``torch.amp.GradScaler("cpu", enabled=True)``.
- ``mixprec O1``: ``wrap(policy="O1")`` (float16 compute, float32 params, dynamic loss scale),
  ``scale_loss`` backward, then ``opt.step()``.
- ``mixprec O1-bf16``: for information — no loss scale, but the step still checks for inf/nan.

Two figures per contender, both from the same samples: ``step`` is the optimizer-step portion
(unscale + inf/nan check + parameter update + scale update) — the figure the target compares —
and ``backward+step`` starts at the scaled backward, which also catches work a backend might
do on leaving ``scale_loss`` instead of in ``step()``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from benchmarks.printing import find
from benchmarks.runner import (
    Case,
    Factory,
    Job,
    JobResult,
    Options,
    compare,
    fmt,
    setup_torch,
)

GROUP = "300 tensors"
CONTENDERS = ("plain step", "GradScaler", "mixprec O1", "mixprec O1-bf16")


def build() -> tuple[Any, Any, Any, Any]:
    torch = setup_torch()
    nn = torch.nn
    torch.manual_seed(0)
    layers: list[Any] = []
    for i in range(150):
        layers.append(nn.Linear(32, 32))
        if i < 149:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    assert len(list(model.parameters())) == 300
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x, y = torch.randn(8, 32), torch.randn(8, 32)
    return model, opt, x, y


def make_sample(contender: str) -> Callable[[], Mapping[str, float]]:
    torch = setup_torch()
    model, opt, x, y = build()
    mse = torch.nn.functional.mse_loss
    clock = time.perf_counter

    if contender == "plain step":

        def sample() -> Mapping[str, float]:
            opt.zero_grad(set_to_none=True)
            loss = mse(model(x), y)
            t0 = clock()
            loss.backward()
            t1 = clock()
            opt.step()
            t2 = clock()
            return {"step": t2 - t1, "backward+step": t2 - t0}

    elif contender == "GradScaler":
        scaler = torch.amp.GradScaler("cpu", enabled=True)

        def sample() -> Mapping[str, float]:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = mse(model(x), y)
            t0 = clock()
            scaler.scale(loss).backward()
            t1 = clock()
            scaler.step(opt)
            scaler.update()
            t2 = clock()
            return {"step": t2 - t1, "backward+step": t2 - t0}

    elif contender.startswith("mixprec "):
        import mixprec

        model, opt = mixprec.torch.wrap(model, opt, policy=contender.split(" ", 1)[1])
        scale_loss = mixprec.torch.scale_loss

        def sample() -> Mapping[str, float]:
            opt.zero_grad(set_to_none=True)
            loss = mse(model(x).float(), y)
            t0 = clock()
            with scale_loss(loss, opt) as scaled:
                scaled.backward()
            t1 = clock()
            opt.step()
            t2 = clock()
            return {"step": t2 - t1, "backward+step": t2 - t0}

    else:
        raise ValueError(f"unknown contender {contender!r}")
    return sample


def factory(contender: str) -> Factory:
    def setup() -> Callable[[], Mapping[str, float]]:
        return make_sample(contender)

    return setup


def run(opts: Options) -> JobResult:
    """Worker: every contender round-robin; then the overhead each adds over the plain step."""
    measurements = compare(
        "step_overhead",
        GROUP,
        {name: factory(name) for name in CONTENDERS},
        warmup=opts.warm(20, 3),
        repeat=opts.reps(300, 30),
        unit="ms",
    )
    lines = []
    plain = find(measurements, GROUP, "plain step", "step")
    scaler = find(measurements, GROUP, "GradScaler", "step")
    ours = find(measurements, GROUP, "mixprec O1", "step")
    if all(m is not None and m.ok for m in (plain, scaler, ours)):
        assert plain and scaler and ours and plain.value and scaler.value and ours.value
        extra_scaler = scaler.value - plain.value
        extra_ours = ours.value - plain.value
        line = (
            f"added over the plain step (medians): GradScaler {fmt(extra_scaler)} ms, "
            f"mixprec O1 {fmt(extra_ours)} ms"
        )
        if extra_ours < 0:  # its update runs torch's foreach SGD, the plain step the for-loop
            line += " — below the plain step: mixprec runs torch's foreach SGD (the same bits)"
        elif extra_scaler > 0:
            line += f" — {extra_ours / extra_scaler:.2f}× GradScaler's addition"
        lines.append(line)
    return JobResult(measurements, lines)


def jobs(opts: Options) -> list[Job]:
    return [Job("step_overhead", "benchmarks.step_overhead:run", {}, GROUP)]


CASE = Case(
    name="step_overhead",
    title="Optimizer-step overhead on 300 small parameter tensors (PyTorch, CPU)",
    jobs=jobs,
    baselines=("plain step", "GradScaler"),
    groups={GROUP: "150 × Linear(32, 32) + ReLU, fp32 params, batch 8, SGD momentum 0.9"},
    order=CONTENDERS,
    method=(
        "Each sample runs zero_grad and the forward untimed, then times the (scaled) backward "
        "and the optimizer-step portion separately with perf_counter. `step` = unscale + inf/nan "
        "check + SGD update + scale update (`scaler.step(opt); scaler.update()` for GradScaler, "
        "`opt.step()` for mixprec and the plain loop). Parameters are float32 in all contenders. "
        "The SGD leaves foreach/fused to torch: the plain step and GradScaler run torch's "
        "per-tensor for-loop on the CPU, mixprec its foreach SGD (the same bits)."
    ),
)
