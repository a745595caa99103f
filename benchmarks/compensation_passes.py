"""The compensated presets' update on PyTorch: fused, its torch fallback, and the generic path.

``python -m benchmarks.compensation_passes [--repeat N] [--threads T]`` times
``optimizer.step()`` of AdamW over case 1's MLP parameters (4 × Linear 2048→2048, 16.8 M)
under ``O3-bf16-kahan``, ``O3-bf16-sr`` and ``O3-bf16-kahan,state=bfloat16``, each three ways,
round-robin in one process with the gradients set once (no forward or backward):

- ``fused``: torch's AdamW takes the fused update, one native pass per tensor
  (:mod:`mixprec_torch.compensated.fused_update`);
- ``fused, torch fallback``: the same arithmetic as torch operations, what a machine without
  a C compiler runs (the same bits);
- ``generic``: a subclass of AdamW, which takes the generic path: float32 working masters
  filled from the weights, torch's own AdamW, rounded back
  (:mod:`mixprec_torch.compensated.compensation`).

and, for reference, ``O2-bf16``'s step (the native guard pass with the cast into float32
master gradients, torch's fused AdamW on the masters, the copy into the bfloat16 weights).
The step includes the guard's pass over the gradients in every contender.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from benchmarks.runner import Measurement, Options, child_env, compare, fmt, setup_torch

METRIC = "optimizer step"
WIDTH = 2048
POLICIES = ("O3-bf16-kahan", "O3-bf16-sr", "O3-bf16-kahan,state=bfloat16")
FORMS = ("fused", "fused, torch fallback", "generic")


def _model(torch: Any) -> Any:
    torch.manual_seed(0)
    layers: list[Any] = []
    for _ in range(4):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def make_sample(policy: str, form: str) -> Callable[[], Mapping[str, float]]:
    """One contender: ``optimizer.step()`` with fixed gradients, timed."""
    torch = setup_torch()
    import mixprec
    from mixprec_torch.cpu import clib as cpu_kernels

    class SubclassedAdamW(torch.optim.AdamW):  # type: ignore[misc,name-defined]
        """AdamW under another class: the generic path."""

    model = _model(torch)
    make = SubclassedAdamW if form == "generic" else torch.optim.AdamW
    model, opt = mixprec.torch.wrap(model, make(model.parameters(), lr=1e-4), policy=policy)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=gen).to(p.dtype) * 1e-3 for p in model.parameters()]
    fallback = form == "fused, torch fallback"
    off = {"lib": None, "reason": "the benchmark's fallback contender"}

    def sample() -> Mapping[str, float]:
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g
        saved = dict(cpu_kernels._state)
        if fallback:
            cpu_kernels._state.clear()
            cpu_kernels._state.update(off)
        try:
            start = time.perf_counter()
            opt.step()
            elapsed = time.perf_counter() - start
        finally:
            cpu_kernels._state.clear()
            cpu_kernels._state.update(saved)
        return {METRIC: elapsed}

    return sample


def _factory(policy: str, form: str) -> Callable[[], Callable[[], Mapping[str, float]]]:
    return lambda: make_sample(policy, form)


def measure(repeat: int, warmup: int) -> list[Measurement]:
    """Every contender, round-robin in this process."""
    contenders = {"O2-bf16": _factory("O2-bf16", "fused")}
    for policy in POLICIES:
        for form in FORMS:
            contenders[f"{policy}, {form}"] = _factory(policy, form)
    return compare("compensation_passes", "mlp", contenders, warmup=warmup, repeat=repeat)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.compensation_passes", description=__doc__
    )
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = p.parse_args(argv)
    import os

    os.environ.update(child_env(Options(threads=args.threads)))
    torch = setup_torch()
    torch.set_num_threads(args.threads)
    found = measure(args.repeat, args.warmup)
    base = next((m.value for m in found if m.contender == "O2-bf16" and m.ok), None)
    print(f"optimizer.step(), AdamW, 16.8 M parameters, {args.threads} thread(s)")
    print(f"{'contender':48s} {'median ms':>10s} {'min–max':>14s} {'× O2-bf16':>10s}")
    for m in found:
        if not m.ok:
            print(f"{m.contender:48s} error: {m.error}")
            continue
        assert m.value is not None and m.lo is not None and m.hi is not None
        ratio = f"{m.value / base:.2f}×" if base else ""
        spread = f"{fmt(m.lo)}–{fmt(m.hi)}"
        print(f"{m.contender:48s} {fmt(m.value):>10s} {spread:>14s} {ratio:>10s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
