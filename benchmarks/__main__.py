"""``python -m benchmarks``: run the side-by-side benchmarks, print tables, check the targets.

Examples::

    python -m benchmarks                                   # every case (about 10 minutes)
    python -m benchmarks --markdown docs/benchmarks.md     # ... and regenerate the page
    python -m benchmarks --quick --only torch_step,startup # a smoke run of two cases
    python -m benchmarks --load run.json --only memory --markdown docs/benchmarks.md
                                                           # re-run one case, keep the rest

Set ``MIXPREC_BENCH_TRACEBACK=1`` to print the traceback of a contender that fails (its table
cell shows only the error's last line).

Each case runs in worker processes of its own (one per framework, one per contender where a
contender changes global state or memory is measured), with the same thread count for
every library (``--threads``, default 2).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import (
    accuracy,
    compensated,
    compensated_gluon,
    cuda,
    dispatch,
    lowbit_state,
    memory,
    mxnet_step,
    report,
    startup,
    state_memory,
    step_overhead,
    torch_compile,
    torch_step,
)
from benchmarks.printing import print_case
from benchmarks.runner import Case, JobResult, Measurement, Options, log, run_job
from benchmarks.targets import evaluate_all, limit_text

CASES: tuple[Case, ...] = (
    torch_step.CASE,
    mxnet_step.CASE,
    step_overhead.CASE,
    dispatch.CASE,
    memory.CASE,
    startup.CASE,
    accuracy.CASE,
    cuda.CASE,
    compensated.CASE,
    compensated_gluon.CASE,
    state_memory.CASE,
    torch_compile.CASE,
    lowbit_state.CASE,
)
BY_NAME = {c.name: c for c in CASES}


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Side-by-side benchmarks of mixprec, torch.amp and mxnet.contrib.amp.",
    )
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="CASE[,CASE]",
        help=f"run only these cases (repeatable): {', '.join(BY_NAME)}",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: few repeats, 1 seed, 2 epochs")
    p.add_argument("--repeat", type=int, help="timed samples per contender (overrides each case)")
    p.add_argument("--warmup", type=int, help="untimed warm-up runs per contender")
    p.add_argument("--seeds", type=int, help="accuracy: number of seeds (default 5, quick 1)")
    p.add_argument("--threads", type=int, default=2, help="threads for every library (default 2)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per worker process")
    p.add_argument("--json", type=Path, metavar="OUT", help="write every figure to this file")
    p.add_argument("--markdown", type=Path, metavar="PAGE", help="regenerate this page")
    p.add_argument(
        "--load",
        type=Path,
        metavar="RUN.json",
        help="start from a saved run; only the --only cases are run again (none without --only)",
    )
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    return p.parse_args(argv)


def selected(args: argparse.Namespace) -> list[Case]:
    names = [n.strip() for item in args.only for n in item.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        sys.exit(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(BY_NAME)}")
    if not names:
        return [] if args.load else list(CASES)
    return [BY_NAME[n] for n in names]


def merge(measurements: list[Measurement]) -> list[Measurement]:
    """One measurement per (group, contender, metric): samples of repeated jobs concatenated."""
    merged: dict[tuple[str, str, str], Measurement] = {}
    for m in measurements:
        key = (m.group, m.contender, m.metric)
        if key not in merged:
            merged[key] = Measurement.from_dict(m.to_dict())
            continue
        into = merged[key]
        into.samples += m.samples
        into.error = into.error or m.error
    return list(merged.values())


def run_case(case: Case, opts: Options) -> JobResult:
    result = JobResult()
    started = time.perf_counter()
    for job in case.jobs(opts):
        log(f"[{case.name}] {job.label}")
        result.extend(run_job(case.name, job, opts))
    result.measurements = case.sorted(merge(result.measurements))
    result.meta["seconds"] = round(time.perf_counter() - started, 1)
    return result


def prepare_outputs(*paths: Path | None) -> None:
    """Before any case runs: every output's folder exists (made if missing) and the file can
    be written, so a run of ten minutes never ends in an ``OSError`` with its figures lost."""
    for path in paths:
        if path is None:
            continue
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            sys.exit(f"cannot create the folder of {path}: {err}")
        if path.is_dir() or not os.access(path if path.exists() else path.parent, os.W_OK):
            sys.exit(f"cannot write {path}: give a file path in a writable folder")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.list:
        for i, case in enumerate(CASES, start=1):
            print(f"{i}. {case.name:<14} {case.title}")
        return 0
    prepare_outputs(args.json, args.markdown)
    opts = Options(
        quick=args.quick,
        repeat=args.repeat,
        warmup=args.warmup,
        threads=args.threads,
        seeds=args.seeds,
        timeout=args.timeout,
    )
    results: dict[str, JobResult] = {}
    run: dict[str, Any] = {}
    if args.load:
        run = json.loads(args.load.read_text())
        results = {name: JobResult.from_dict(r) for name, r in run["cases"].items()}
    to_run = selected(args)
    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    machine = report.machine() if to_run or not run else {}
    stamp = report.cpu_stamp(machine) if machine else ""
    if to_run:
        log(f"CPU: {stamp}")
    for case in to_run:
        results[case.name] = run_case(case, opts)
        results[case.name].meta["cpu"] = stamp  # a --load re-run may come from another CPU
        print_case(case, results[case.name])
    if run and to_run:  # a partial re-run on top of a loaded run: keep the run's own facts
        run.setdefault("reruns", []).append(
            {
                "command": " ".join(["python -m benchmarks", *map(shlex.quote, argv)]),
                "started": report.now(),
                "cases": [c.name for c in to_run],
                "cpu": stamp,
            }
        )
    elif not run:
        run.update(
            command=" ".join(["python -m benchmarks", *map(shlex.quote, argv)]),
            started=report.now(),
            duration_s=time.perf_counter() - started,
            options=opts.to_dict(),
            machine=machine,
            load_average={"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)},
        )
    run["cases"] = {name: r.to_dict() for name, r in results.items()}
    measurements = [m for r in results.values() for m in r.measurements]
    verdicts = evaluate_all(measurements, results)
    run["verdicts"] = [
        {
            "id": v.target.id,
            "target": v.target.text,
            "status": v.status,
            "value": v.value,
            "detail": v.detail,
        }
        for v in verdicts
    ]
    if verdicts:
        print("\n== targets ==")
        width = max(len(v.target.text) for v in verdicts)
        for v in verdicts:
            print(
                f"  {v.status.upper():<12} {v.target.text:<{width}}  ({limit_text(v.target)}): "
                f"{v.detail}"
            )
    if args.json:
        args.json.write_text(json.dumps(run, indent=1) + "\n")
        log(f"wrote {args.json}")
    if args.markdown:
        ordered = {c.name: results[c.name] for c in CASES if c.name in results}
        args.markdown.write_text(report.render(run, CASES, ordered))
        log(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
