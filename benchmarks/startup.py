"""Case 6 — start-up: ``import mixprec``, loading a backend, and ``wrap`` on 1,000 modules.

- ``import mixprec``: a fresh interpreter per sample runs
  ``t = perf_counter(); import mixprec; print(perf_counter() - t)`` — the import alone, not the
  interpreter's own start. One extra run under ``python -X importtime`` lists the slowest
  modules it pulled in, and the run checks that no framework got imported.
- ``backend load``: in a fresh interpreter that has already imported the framework, the first
  attribute access ``mixprec.torch.wrap`` / ``mixprec.mxnet.Trainer`` (plugin discovery and the
  backend's own modules; the framework's import is not counted).
- ``wrap``: a model of 1,000 modules — 250 × (Linear 16→16, BatchNorm1d, ReLU, Dropout) — and
  its AdamW optimizer, built fresh (untimed) for every sample, then
  ``mixprec.torch.wrap(model, opt, policy=...)`` timed. The first call of the process runs
  as warm-up and is not part of the median.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from typing import Any

from benchmarks.runner import (
    REPO_ROOT,
    Case,
    Job,
    JobResult,
    Measurement,
    Options,
    error_text,
    log,
    setup_torch,
)

IMPORT = "import"
WRAP = "wrap, 1,000 modules"
WRAP_PRESETS = ("O1-bf16", "O2-bf16")
_PROBE = (
    "import time, sys; t = time.perf_counter(); import mixprec; d = time.perf_counter() - t; "
    "print(d, *[m for m in ('torch', 'mxnet', 'numpy') if m in sys.modules])"
)


def _python(code: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *flags, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def import_time(opts: Options) -> JobResult:
    """Worker: ``import mixprec`` in fresh interpreters; the slowest imported modules."""
    result = JobResult()
    samples, frameworks = [], set()
    error = None
    for _ in range(opts.reps(20, 5)):
        proc = _python(_PROBE)
        if proc.returncode != 0:
            error = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            break
        seconds, *loaded = proc.stdout.split()
        samples.append(float(seconds) * 1e3)
        frameworks.update(loaded)
    result.measurements.append(
        Measurement("startup", IMPORT, "import mixprec", "import", "ms", samples, error)
    )
    if frameworks:
        result.lines.append(f"`import mixprec` imported {', '.join(sorted(frameworks))}")
    elif samples:
        result.lines.append("`import mixprec` imported none of torch, mxnet, numpy")
    proc = _python("import mixprec", "-X", "importtime")
    # Lines are "import time: self [us] | cumulative | name", children before their parent;
    # what ``import mixprec`` pulled in are the lines between the previous top-level import
    # and mixprec's own line.
    nested: list[tuple[int, str]] = []
    for line in proc.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
        if not m:
            continue
        top_level = m.group(3) == " "
        if top_level and m.group(4) == "mixprec":
            pulled = ", ".join(
                f"{n} {us / 1e3:.1f} ms" for us, n in sorted(nested, reverse=True)[:5]
            )
            result.lines.append(
                f"-X importtime: mixprec {int(m.group(2)) / 1e3:.1f} ms cumulative; "
                f"largest modules it imports: {pulled or 'none'}"
            )
            break
        nested = [] if top_level else [*nested, (int(m.group(2)), m.group(4))]
    for framework, attribute in (("torch", "wrap"), ("mxnet", "Trainer")):
        code = (
            f"import {framework}, time; t = time.perf_counter(); import mixprec; "
            f"getattr(mixprec.{framework}, {attribute!r}); print(time.perf_counter() - t)"
        )
        samples, error = [], None
        for _ in range(opts.reps(5, 2)):
            proc = _python(code)
            if proc.returncode != 0:
                error = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                break
            samples.append(float(proc.stdout.split()[-1]) * 1e3)
        result.measurements.append(
            Measurement(
                "startup",
                IMPORT,
                f"mixprec.{framework} backend load",
                "first use",
                "ms",
                samples,
                error,
                note=f"{framework} already imported",
            )
        )
    return result


def _thousand_modules() -> tuple[Any, Any]:
    torch = setup_torch()
    nn = torch.nn
    layers: list[Any] = []
    for _ in range(250):
        layers += [nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.1)]
    model = nn.Sequential(*layers)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def wrap_time(opts: Options) -> JobResult:
    """Worker: ``mixprec.torch.wrap`` on a fresh 1,000-module model per sample."""
    setup_torch()
    model, _ = _thousand_modules()
    leaves = sum(1 for m in model.modules() if not list(m.children()))
    result = JobResult(lines=[f"wrap model: {leaves} leaf modules (+1 Sequential)"])
    for preset in WRAP_PRESETS:
        contender = f"wrap {preset}"
        try:
            import mixprec

            first = None
            samples = []
            for i in range(opts.reps(10, 3) + 1):
                model, opt = _thousand_modules()
                start = time.perf_counter()
                mixprec.torch.wrap(model, opt, policy=preset)
                elapsed = (time.perf_counter() - start) * 1e3
                if i == 0:
                    first = elapsed
                else:
                    samples.append(elapsed)
            log(f"    {WRAP} / {contender}: first {first:.1f} ms, then median of {len(samples)}")
            result.measurements.append(
                Measurement(
                    "startup",
                    WRAP,
                    contender,
                    "wrap",
                    "ms",
                    samples,
                    note=f"first call in the process: {first:.0f} ms",
                )
            )
        except Exception as exc:
            result.measurements.append(
                Measurement("startup", WRAP, contender, "wrap", "ms", error=error_text(exc))
            )
    return result


def jobs(opts: Options) -> list[Job]:
    return [
        Job("startup import", "benchmarks.startup:import_time", {}, IMPORT),
        Job("startup wrap", "benchmarks.startup:wrap_time", {}, WRAP),
    ]


CASE = Case(
    name="startup",
    title="Start-up: import mixprec, backend load, wrap of 1,000 modules",
    jobs=jobs,
    groups={
        IMPORT: "fresh interpreter per sample",
        WRAP: "250 × (Linear 16→16, BatchNorm1d, ReLU, Dropout) + AdamW, fresh per sample",
    },
    method=(
        "`import mixprec`: a fresh interpreter per sample times the import statement alone with "
        "perf_counter. Backend load: the first `mixprec.torch.wrap` / `mixprec.mxnet.Trainer` "
        "attribute access in a fresh interpreter that has already imported the framework. "
        "`wrap`: a fresh 1,000-module model and optimizer per sample (untimed), then the `wrap` "
        "call alone; the process's first call is warm-up and is shown in the notes."
    ),
)
