"""The cost of O2's float32 master gradients around ``zero_grad(set_to_none=...)`` (issue 14).

``python -m benchmarks.master_grads [--repeat N]`` runs the timing twice, in two fresh
processes: once with glibc's malloc thresholds pinned as every benchmark worker pins them
(:func:`benchmarks.runner.child_env`), once with glibc's defaults, where a freed 16 MiB
buffer goes back to the OS and is page-faulted in again when it is next allocated.

The model is case 1's MLP (4 × Linear 2048→2048 + GELU, AdamW, 16.8 M parameters) on a batch
of 8: the figure is only the part of the step that the master gradients touch, so the batch
does not matter, and on an AVX2-only CPU a bfloat16 matmul is so slow that a batch of 256
would make one sample take seconds. One sample runs ``zero_grad`` (timed), the forward and
backward (untimed), ``mixprec.torch.unscale_`` (timed: the cast of the model gradients into
the masters' gradients and the overflow check), then ``optimizer.step()`` (timed: AdamW over
the float32 masters, the copy back into the bfloat16 model); the minor page faults of the
timed parts are counted with ``getrusage``. Three contenders, timed round-robin in one
process: ``zero_grad(set_to_none=True)`` as it is now (the masters' gradient memory kept),
the same with that memory forgotten after each ``zero_grad`` (the behaviour before issue
14's change: a fresh allocation every step), and ``zero_grad(set_to_none=False)``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from benchmarks.runner import Options, child_env, compare, fmt, setup_torch
from benchmarks.torch_step import build

BATCH = 8
MALLOC_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
GRADS = "zero_grad + unscale_"
WHOLE = "zero_grad + unscale_ + step"
# (set_to_none, keep the master-gradient memory): (True, False) is the behaviour before
# issue 14's change, rebuilt by forgetting the kept memory after each zero_grad
CONTENDERS = ((True, True), (True, False), (False, True))


def name(contender: tuple[bool, bool]) -> str:
    set_to_none, keep = contender
    old = "" if keep else ", memory not kept (as before)"
    return f"O2-bf16, zero_grad(set_to_none={set_to_none}){old}"


def make_sample(
    contender: tuple[bool, bool], faults: list[tuple[int, int]]
) -> Callable[[], Mapping[str, float]]:
    """One contender's sample: zero_grad, unscale_ and step timed, forward and backward not;
    appends the minor page faults of (zero_grad + unscale_, the whole timed part) to
    ``faults``."""
    torch = setup_torch()
    import mixprec

    set_to_none, keep = contender
    model, x, y, loss_fn = build("mlp")
    x, y = x[:BATCH], y[:BATCH]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = mixprec.torch.wrap(model, opt, policy="O2-bf16")

    def sample() -> Mapping[str, float]:
        f0, start = _minflt(), time.perf_counter()
        opt.zero_grad(set_to_none=set_to_none)
        if not keep:
            opt._mixprec.spare_grads.clear()  # each step allocates its master gradients
        f1, zeroed = _minflt(), time.perf_counter()
        loss_fn(model(x).float(), y).backward()
        f2, cast = _minflt(), time.perf_counter()
        mixprec.torch.unscale_(opt)  # the cast into the masters' gradients, and the check
        f3, stepping = _minflt(), time.perf_counter()
        opt.step()
        f4, done = _minflt(), time.perf_counter()
        faults.append(((f1 - f0) + (f3 - f2), (f1 - f0) + (f4 - f2)))
        return {
            GRADS: (zeroed - start) + (stepping - cast),
            "step after unscale_": done - stepping,
            WHOLE: (zeroed - start) + (done - cast),
        }

    return sample


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def measure(repeat: int, warmup: int) -> dict[str, list[float]]:
    """In this process: every contender's figures, as [median, min, max]; times in ms,
    minor page faults per sample (the figures after warm-up)."""
    faults: dict[str, list[tuple[int, int]]] = {name(s): [] for s in CONTENDERS}
    contenders = {
        name(s): (lambda s=s: make_sample(s, faults[name(s)]))  # type: ignore[misc]
        for s in CONTENDERS
    }
    found = compare("master_grads", "mlp", contenders, warmup=warmup, repeat=repeat)
    out = {
        f"{m.contender} [{m.metric}]": [v for v in (m.value, m.lo, m.hi) if v is not None]
        for m in found
        if m.ok
    }
    for contender, pairs in faults.items():
        timed = pairs[warmup:]
        for i, metric in enumerate((GRADS, WHOLE)):
            counts = [float(p[i]) for p in timed]
            key = f"{contender} [page faults, {metric}]"
            out[key] = [statistics.median(counts), min(counts), max(counts)]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.master_grads", description=__doc__)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.repeat, args.warmup)))
        return 0
    pinned = child_env(Options(threads=args.threads))
    defaults = {k: v for k, v in pinned.items() if k not in MALLOC_VARS}
    cmd = [sys.executable, "-m", "benchmarks.master_grads", "--child"]
    cmd += ["--repeat", str(args.repeat), "--warmup", str(args.warmup)]
    results: dict[str, dict[str, Any]] = {}
    for label, env in (("pinned thresholds", pinned), ("glibc defaults", defaults)):
        print(f"running with {label} ...", file=sys.stderr, flush=True)
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
        results[label] = json.loads(out.stdout.strip().splitlines()[-1])
    print_table("O2-bf16 MLP, 16.8 M params", results)
    print(f"(median and min–max of {args.repeat} samples: ms, or minor page faults)")
    return 0


def print_table(title: str, results: Mapping[str, Mapping[str, Any]]) -> None:
    """One markdown row per ``"contender [metric]"`` key, one column per malloc setting."""
    print(f"| {title} | metric | " + " | ".join(results) + " |")
    print("|---|---|" + "---|" * len(results))
    for key in next(iter(results.values())):
        contender, metric = key.rsplit(" [", 1)
        cells = [_cell(r.get(key)) for r in results.values()]
        print(f"| {contender} | {metric.rstrip(']')} | " + " | ".join(cells) + " |")


def _cell(figures: list[float] | None) -> str:
    if not figures:
        return "—"
    median, lo, hi = figures
    return f"{fmt(median)} ({fmt(lo)}–{fmt(hi)})"


if __name__ == "__main__":
    sys.exit(main())
