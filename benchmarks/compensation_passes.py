"""The compensated presets' own passes on PyTorch, sliced and in one piece (issue 14).

``python -m benchmarks.compensation_passes [--repeat N]`` times ``Compensation.fill()`` +
``Compensation.store()`` (what ``O3-bf16-kahan`` and ``O3-bf16-sr`` do around the
optimizer's update; here the update is a constant ``+ 1e-4``) for case 1's MLP parameters
(4 × Linear 2048→2048, 16.8 M), with glibc's malloc thresholds pinned as every benchmark
worker pins them (:func:`benchmarks.runner.child_env`) and with glibc's defaults. Three
contenders per strategy, each in a process of its own (page faults depend on what the
process allocated and freed before): the passes as they run (slices of
``mixprec_torch.state_rounding._SLICE`` elements); in one piece (the slice set to the whole
buffer: how they ran before), which builds model-sized temporaries for the mixed-dtype
operations and the stochastic rounding's noise; and sliced with the float32 working buffer
kept between steps (``_Flat.release`` and ``allocate`` skipped): what giving its 4 bytes per
parameter back between steps costs in page faults. Minor page faults of the timed part are
counted with ``getrusage``.
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

from benchmarks.master_grads import MALLOC_VARS, print_table
from benchmarks.runner import Options, child_env, compare, setup_torch

METRIC = "fill + store"
STRATEGIES = ("kahan", "stochastic")
SHAPES = [(2048, 2048)] * 4 + [(2048,)] * 4


FORMS = ("sliced", "one piece (before)", "sliced, buffer kept")


def make_sample(strategy: str, form: str, faults: list[int]) -> Callable[[], Mapping[str, float]]:
    """One contender: the strategy's two passes, timed; appends their page faults."""
    torch = setup_torch()
    from mixprec_torch import state_rounding
    from mixprec_torch.compensation import Compensation

    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen).to(torch.bfloat16) for s in SHAPES]
    masters = [p.float() + 1e-3 * torch.randn(p.shape, generator=gen) for p in params]
    comp = Compensation(list(zip(params, masters, strict=True)), strategy)
    if form == "sliced, buffer kept":  # allocated once, never given back
        for flat in comp.flats:
            flat.allocate()
            flat.allocate = flat.release = lambda: None  # type: ignore[method-assign]
    # the optimizer whose update the passes surround (its own update is replaced by a
    # constant step below; it keeps no state to widen)
    optimizer = torch.optim.SGD(masters, lr=0.0)
    whole = sum(p.numel() for p in params)

    def sample() -> Mapping[str, float]:
        saved = state_rounding._SLICE
        if form == "one piece (before)":
            state_rounding._SLICE = whole
        try:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            comp.fill(optimizer)
            torch._foreach_add_(comp.flats[0].masters, 1e-4)
            comp.store(optimizer)
            elapsed = time.perf_counter() - start
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        finally:
            state_rounding._SLICE = saved
        return {METRIC: elapsed}

    return sample


def name(strategy: str, form: str) -> str:
    return f"{strategy}, {form}"


def measure(
    repeat: int, warmup: int, strategies: Sequence[str] = STRATEGIES, forms: Sequence[str] = FORMS
) -> dict[str, list[float]]:
    """Time the given contenders in this process (``main`` runs one per process)."""
    out: dict[str, list[float]] = {}
    for strategy in strategies:
        for form in forms:
            key, faults = name(strategy, form), list[int]()
            found = compare(
                "compensation_passes",
                "mlp",
                {key: _factory(strategy, form, faults)},
                warmup=warmup,
                repeat=repeat,
            )
            for m in found:
                if m.ok:
                    out[f"{key} [{m.metric}, ms]"] = [
                        v for v in (m.value, m.lo, m.hi) if v is not None
                    ]
            timed = [float(c) for c in faults[warmup:]]
            out[f"{key} [page faults]"] = [statistics.median(timed), min(timed), max(timed)]
    return out


def _factory(
    strategy: str, form: str, faults: list[int]
) -> Callable[[], Callable[[], Mapping[str, float]]]:
    return lambda: make_sample(strategy, form, faults)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.compensation_passes", description=__doc__
    )
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--child", nargs=2, metavar=("STRATEGY", "FORM"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        strategy, form = args.child
        print(json.dumps(measure(args.repeat, args.warmup, [strategy], [form])))
        return 0
    pinned = child_env(Options(threads=args.threads))
    defaults = {k: v for k, v in pinned.items() if k not in MALLOC_VARS}
    cmd = [sys.executable, "-m", "benchmarks.compensation_passes"]
    cmd += ["--repeat", str(args.repeat), "--warmup", str(args.warmup)]
    results: dict[str, dict[str, Any]] = {}
    for label, env in (("pinned thresholds", pinned), ("glibc defaults", defaults)):
        print(f"running with {label} ...", file=sys.stderr, flush=True)
        results[label] = {}
        for strategy in STRATEGIES:
            for form in FORMS:
                child = [*cmd, "--child", strategy, form]
                out = subprocess.run(child, env=env, check=True, capture_output=True, text=True)
                results[label].update(json.loads(out.stdout.strip().splitlines()[-1]))
    print_table("16.8 M params", results)
    print(f"(median and min–max of {args.repeat} samples)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
