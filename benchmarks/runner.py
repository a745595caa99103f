"""The timing harness: warm-up, repeated measurement, medians, min–max and ratios.

Everything a case measures becomes a :class:`Measurement` (its raw samples plus the headline
statistic). Contenders that are compared with each other are timed *round-robin* in one
process: every round runs each contender once, starting from a different one each round, so
that a slow phase of a busy machine hits all of them alike and the ratios printed at the end
are taken from the same run. A contender that fails while it is set up, warmed up or timed is
recorded with its error and the others carry on ("fail soft").

Frameworks are imported only inside the functions that the worker processes run (see
:mod:`benchmarks.worker`); this module stays importable without torch or mxnet.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
THREADS_ENV = "MIXPREC_BENCH_THREADS"

# ----------------------------------------------------------------------------- data


@dataclass
class Measurement:
    """One contender's figure in one group of one case, with every raw sample kept."""

    case: str
    group: str
    contender: str
    metric: str  # what was measured: "step", "peak tensor memory", "accuracy", ...
    unit: str  # "ms", "MiB", "%", "s"
    samples: list[float] = field(default_factory=list)
    error: str | None = None
    headline: str = "median"  # "median" (timings) or "mean" (accuracy over seeds)
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.samples)

    @property
    def value(self) -> float | None:
        """The headline statistic: the median, or the mean for ``headline="mean"``."""
        if not self.ok:
            return None
        if self.headline == "mean":
            return statistics.fmean(self.samples)
        return statistics.median(self.samples)

    @property
    def lo(self) -> float | None:
        return min(self.samples) if self.ok else None

    @property
    def hi(self) -> float | None:
        return max(self.samples) if self.ok else None

    @property
    def stdev(self) -> float | None:
        return statistics.stdev(self.samples) if self.ok and len(self.samples) > 1 else None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Measurement:
        return cls(**data)


@dataclass
class JobResult:
    """What one worker process hands back: measurements, free-text lines, facts (``meta``)."""

    measurements: list[Measurement] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def extend(self, other: JobResult) -> None:
        self.measurements.extend(other.measurements)
        self.lines.extend(other.lines)
        for key, value in other.meta.items():
            mine = self.meta.get(key)
            if isinstance(mine, dict) and isinstance(value, dict):
                mine.update(value)
            else:
                self.meta[key] = value

    def to_dict(self) -> dict[str, Any]:
        return {
            "measurements": [m.to_dict() for m in self.measurements],
            "lines": list(self.lines),
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobResult:
        return cls(
            [Measurement.from_dict(m) for m in data.get("measurements", [])],
            list(data.get("lines", [])),
            dict(data.get("meta", {})),
        )


@dataclass(frozen=True)
class Options:
    """The knobs of one run, as given on the command line."""

    quick: bool = False
    repeat: int | None = None  # overrides every case's repeat count
    warmup: int | None = None  # overrides every case's warm-up count
    threads: int = 2
    seeds: int | None = None  # accuracy: overrides the number of seeds
    timeout: float = 1800.0  # seconds for one worker process

    def reps(self, full: int, quick: int) -> int:
        """The repeat count for a case whose defaults are ``full`` / ``quick``."""
        return self.repeat if self.repeat is not None else (quick if self.quick else full)

    def warm(self, full: int, quick: int = 1) -> int:
        return self.warmup if self.warmup is not None else (quick if self.quick else full)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Options:
        return cls(**data)


@dataclass(frozen=True)
class Job:
    """One worker process: ``module.function(options, **kwargs)`` returning a JobResult."""

    label: str  # names the job in progress lines and in a crash report
    function: str  # "benchmarks.torch_step:run_model"
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    group: str = ""  # group and contender of the error measurement if the process dies
    contender: str = "(worker)"


@dataclass(frozen=True)
class Case:
    """A benchmark case: its title, how it is split into worker processes, its ratio columns."""

    name: str
    title: str
    jobs: Callable[[Options], list[Job]]
    baselines: tuple[str, ...] = ()  # contenders that ratio columns divide by
    groups: Mapping[str, str] = field(default_factory=dict)  # group name -> description
    method: str = ""  # one paragraph: what exactly is timed
    order: tuple[str, ...] = ()  # contenders in the order tables list them (others after)
    # a "Δ" column: headline minus that of the first of these contenders present in the group
    differences: tuple[str, ...] = ()

    def sorted(self, measurements: Iterable[Measurement]) -> list[Measurement]:
        """Measurements grouped by group (in ``groups`` order), contenders in ``order``."""
        groups = list(self.groups)

        def key(m: Measurement) -> tuple[int, int]:
            g = groups.index(m.group) if m.group in groups else len(groups)
            c = self.order.index(m.contender) if m.contender in self.order else len(self.order)
            return g, c

        return sorted(measurements, key=key)  # stable: metrics keep their order


def fmt(value: float | None, digits: int = 3) -> str:
    """A number with about ``digits`` significant figures (no exponent for everyday sizes)."""
    if value is None:
        return "—"
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 10 ** (digits - 1):
        return f"{value:.0f}"
    decimals = digits - 1 - int(f"{magnitude:e}".split("e")[1])
    return f"{value:.{max(0, decimals)}f}"


def error_text(exc: BaseException) -> str:
    """A one-line description of an exception, short enough for a table cell."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ").strip()
    return text if len(text) <= 300 else text[:297] + "..."


def log(message: str) -> None:
    """Progress output of workers and the parent (stderr, so stdout stays the tables)."""
    print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- timing

# A contender is a factory: called once (setup), it returns the function that runs one sample.
# That function either returns None (the harness times the whole call) or a dict
# {metric: seconds} when only part of the call is to be timed (e.g. the optimizer step after an
# untimed backward). It must leave no asynchronous work pending (mx.nd.waitall(),
# torch.cuda.synchronize()).
SampleFn = Callable[[], "Mapping[str, float] | None"]
Factory = Callable[[], SampleFn]


def compare(
    case: str,
    group: str,
    contenders: Mapping[str, Factory],
    *,
    warmup: int,
    repeat: int,
    metric: str = "step",
    unit: str = "ms",
    notes: Mapping[str, str] | None = None,
) -> list[Measurement]:
    """Time every contender ``repeat`` times, round-robin, after ``warmup`` untimed runs each."""
    scale = {"ms": 1e3, "us": 1e6, "s": 1.0}[unit]
    notes = notes or {}
    fns: dict[str, SampleFn] = {}
    results: dict[str, dict[str, Measurement]] = {}
    failed: dict[str, str] = {}

    def record(name: str, metric_name: str) -> Measurement:
        per = results.setdefault(name, {})
        if metric_name not in per:
            per[metric_name] = Measurement(
                case, group, name, metric_name, unit, note=notes.get(name, "")
            )
        return per[metric_name]

    for name, factory in contenders.items():
        try:
            fns[name] = factory()
            for _ in range(warmup):
                fns[name]()
        except Exception as exc:
            failed[name] = error_text(exc)
            fns.pop(name, None)
            log(f"    {group} / {name}: error: {failed[name]}")
            if os.environ.get("MIXPREC_BENCH_TRACEBACK"):
                traceback.print_exc()
    names = list(fns)
    for round_no in range(repeat):
        shift = round_no % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            if name in failed:
                continue
            try:
                start = time.perf_counter()
                parts = fns[name]()
                elapsed = time.perf_counter() - start
            except Exception as exc:
                failed[name] = error_text(exc)
                log(f"    {group} / {name}: error while timing: {failed[name]}")
                continue
            if parts:
                for metric_name, seconds in parts.items():
                    record(name, metric_name).samples.append(seconds * scale)
            else:
                record(name, metric).samples.append(elapsed * scale)
    out: list[Measurement] = []
    for name in contenders:
        note = notes.get(name, "")
        if name in failed:
            out.append(Measurement(case, group, name, metric, unit, error=failed[name], note=note))
        elif name in results:
            out.extend(results[name].values())
        else:
            out.append(Measurement(case, group, name, metric, unit, error="no samples", note=note))
    for m in out:
        if m.ok:
            log(f"    {group} / {m.contender} [{m.metric}]: {fmt(m.value)} {m.unit}")
    return out


def threads() -> int:
    """The thread count this worker was started with (``--threads``)."""
    return int(os.environ.get(THREADS_ENV, "2"))


def setup_torch() -> Any:
    """Import torch and pin its intra-op threads to ``--threads``; return the module."""
    import torch

    torch.set_num_threads(threads())
    return torch


# ----------------------------------------------------------------------------- processes


def child_env(opts: Options) -> dict[str, str]:
    """The environment of a worker: one thread count for every library, repo on the path."""
    env = dict(os.environ)
    n = str(opts.threads)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", THREADS_ENV):
        env[var] = n
    env["MXNET_CPU_WORKER_NTHREADS"] = "1"  # MXNet's engine threads; OMP does the op threads
    # glibc hands large freed blocks back to the OS and page-faults them in again; which step
    # pays depends on the heap's history, so medians came out bimodal (60 or 90 ms for one
    # contender). Pinning the thresholds measures every contender in its steady state.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 * 2**20))
    env.setdefault("MALLOC_TRIM_THRESHOLD_", str(4 * 2**30))
    env.setdefault("MALLOC_TOP_PAD_", str(256 * 2**20))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def run_job(case: str, job: Job, opts: Options) -> JobResult:
    """Run ``job`` in a fresh Python process and return what it measured (never raises)."""
    with tempfile.TemporaryDirectory(prefix="mixprec-bench-") as tmp:
        out = Path(tmp) / "result.json"
        request = {"function": job.function, "kwargs": dict(job.kwargs), "options": opts.to_dict()}
        cmd = [sys.executable, "-m", "benchmarks.worker", json.dumps(request), str(out)]
        tail: list[str] = []
        started = time.perf_counter()
        proc = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            env=child_env(opts),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

        def relay() -> None:  # echo the worker's progress live, keep its last lines
            assert proc.stdout is not None
            for raw in proc.stdout:
                line = raw.rstrip("\n")
                tail.append(line)
                del tail[:-20]
                if not _noise(line):
                    log(line)

        reader = threading.Thread(target=relay, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=opts.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            tail.append(f"killed after {opts.timeout:.0f} s (--timeout)")
        reader.join(timeout=5)
        elapsed = time.perf_counter() - started
        if out.exists():
            result = JobResult.from_dict(json.loads(out.read_text()))
            result.meta.setdefault("job_seconds", {})[job.label] = round(elapsed, 1)
            return result
    why = f"exited with status {rc}"
    last = next((t for t in reversed(tail) if t.strip() and not _noise(t)), "")
    error = f"worker {why}: {last}".strip()
    return JobResult(
        [Measurement(case, job.group or job.label, job.contender, "", "", error=error)]
    )


def _noise(line: str) -> bool:
    """Lines that libraries print on their own and that say nothing about the benchmark."""
    return line.startswith(("USDT:", "STAGE:")) or "SyncActivityProfilerHandler" in line
