"""The machine description and docs/benchmarks.md, generated from a run's results.

The page's prose lives in ``benchmarks/template.md`` and is written by hand; the generator
fills its placeholders:

- ``{{generated}}``: when, by which command, and a warning if the figures are a ``--quick`` run
- ``{{machine}}``, ``{{targets}}``, ``{{results}}``: tables (each case's names its CPU)
- ``{{cpu}}``: the CPU of the run in one line (:func:`cpu_stamp`)
- ``{{target:ID}}``: one target's figure and verdict inline, e.g. "0.52× … — **met**"
- ``{{figure:CASE/GROUP/CONTENDER}}`` (optionally ``/METRIC``): one headline figure inline

This module imports no framework: versions come from the installed distributions' metadata.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.printing import find, fmt, table_rows
from benchmarks.runner import REPO_ROOT, Case, JobResult
from benchmarks.targets import TARGETS, Verdict, evaluate, limit_text

TEMPLATE = Path(__file__).with_name("template.md")
DISTRIBUTIONS = ("mixprec", "mixprec-numpy", "torch", "mxnet", "numpy", "scikit-learn", "pluggy")
CPU_FLAGS = ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16", "f16c")
#: the variables that cap oneDNN's and ATen's ISA below the CPU's (the AVX2 emulation)
ISA_VARS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
_TORCH_CPU = (
    "import json, torch; from mixprec_torch.devices import capabilities; "
    "cpu = capabilities().device('cpu'); print(json.dumps({'capability': "
    "str(torch.backends.cpu.get_cpu_capability()), 'fast': list(cpu.fast_dtypes), "
    "'note': cpu.note}))"
)


def machine() -> dict[str, Any]:
    """Facts about this machine and software that a reader needs to weigh the figures."""
    info: dict[str, Any] = {}
    cpuinfo = _read("/proc/cpuinfo")
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    info["cpu"] = model.group(1).strip() if model else platform.processor() or "unknown"
    flags_line = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.M)
    flags = set(flags_line.group(1).split()) if flags_line else set()
    info["cpu_flags"] = {flag: flag in flags for flag in CPU_FLAGS}
    info["cpu_isa"] = cpu_isa()
    info["cores"] = os.cpu_count()
    info["cores_usable"] = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    )
    mem = re.search(r"^MemTotal:\s*(\d+) kB", _read("/proc/meminfo"), re.M)
    info["memory_gib"] = round(int(mem.group(1)) / 2**20, 1) if mem else None
    info["os"] = platform.platform()
    info["python"] = platform.python_version()
    versions = {}
    for dist in DISTRIBUTIONS:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "not installed"
    info["versions"] = versions
    info["git"] = _git()
    return info


def cpu_isa() -> dict[str, Any]:
    """What torch makes of this CPU, as the workers see it: ATen's capability, whether
    bfloat16 is fast (mixprec's probe) and why, and the variables that cap the ISA. Asked of a
    child process (this module imports no framework) with the workers' environment."""
    info: dict[str, Any] = {"env": {var: os.environ[var] for var in ISA_VARS if var in os.environ}}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    try:
        out = subprocess.run(
            [sys.executable, "-c", _TORCH_CPU], capture_output=True, text=True, timeout=120,
            env=env, check=True,
        ).stdout  # fmt: skip
        info.update(json.loads(out.strip().splitlines()[-1]))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        info["error"] = f"{type(exc).__name__}: torch could not be asked ({exc})"[:200]
    return info


def cpu_stamp(machine: Mapping[str, Any]) -> str:
    """One line naming the CPU a table came from: the model, torch's capability, the
    bfloat16 flags, and whether its ISA was capped (the AVX2 emulation) or native."""
    isa = machine.get("cpu_isa")
    if not isa:
        return f"{machine.get('cpu', 'unknown CPU')} (run taken before CPU stamps: ISA unknown)"
    flags = machine.get("cpu_flags", {})
    have = [f for f in ("avx512_bf16", "amx_bf16", "avx512_fp16") if flags.get(f)]
    parts = [f"torch capability {isa.get('capability', '?')}"]
    parts.append("flags " + ", ".join(have) if have else "no avx512_bf16/amx_bf16 flag")
    if "fast" in isa:
        fast = ", ".join(isa["fast"]) or "none"
        parts.append(f"fast low precision: {fast}")
    capped = " ".join(f"{k}={v}" for k, v in isa.get("env", {}).items())
    parts.append(f"emulated: {capped}" if capped else "native ISA (not emulated)")
    return f"{machine.get('cpu', 'unknown CPU')} — {'; '.join(parts)}"


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _git() -> str:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}{' (with uncommitted changes)' if dirty else ''}" if head else "unknown"


# ----------------------------------------------------------------------------- markdown


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |"]
    lines.append("|" + "|".join("---" for _ in header) + "|")
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def machine_md(run: Mapping[str, Any]) -> str:
    m = run["machine"]
    flags = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in m["cpu_flags"].items())
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    opts = run["options"]
    load = run.get("load_average", {})
    rows = [
        ("CPU", m["cpu"]),
        ("cores", f"{m['cores']} (usable by this process: {m['cores_usable']})"),
        ("CPU features", flags),
        ("torch on this CPU", cpu_stamp(m).split(" — ", 1)[-1]),
        ("memory", f"{m['memory_gib']} GiB"),
        ("OS", m["os"]),
        ("Python", m["python"]),
        ("versions", versions),
        ("git", m["git"]),
        ("threads", f"{opts['threads']} (OMP/MKL_NUM_THREADS and torch.set_num_threads)"),
        ("load average", f"{load.get('start', '?')} at start, {load.get('end', '?')} at end"),
        ("date", run["started"]),
        ("duration", f"{run['duration_s']:.0f} s"),
    ]
    return md_table(["", ""], rows)


def targets_md(verdicts: Sequence[Verdict]) -> str:
    marks = {"met": "**met**", "missed": "**missed**", "not measured": "not measured"}
    rows = [[v.target.text, limit_text(v.target), v.detail, marks[v.status]] for v in verdicts]
    return md_table(["target", "limit", "figure (this run)", "verdict"], rows)


def case_md(
    number: int, case: Case, result: JobResult | None, machine: Mapping[str, Any] | None = None
) -> str:
    out = [f"### {number}. {case.title}", "", case.method, ""]
    if result is None:
        out.append("_Not run in this run._")
        return "\n".join(out)
    stamp = result.meta.get("cpu") or (cpu_stamp(machine) if machine else None)
    if stamp:
        out += [f"CPU of these tables: {stamp}.", ""]
    out += [f"- {line}" for line in result.lines]
    if result.lines:
        out.append("")
    header, groups = table_rows(result.measurements, case.baselines, case.differences)
    for group, rows in groups.items():
        desc = case.groups.get(group, "")
        out.append(f"**{group}**" + (f" — {desc}" if desc else ""))
        out.append("")
        notes = {m.contender: m.note for m in result.measurements if m.group == group and m.note}
        if notes:
            header_n = [*header, "note"]
            rows = [[*r, notes.get(r[0], "")] for r in rows]
        else:
            header_n = header
        out.append(md_table(header_n, rows))
        out.append("")
    return "\n".join(out).rstrip()


def render(run: Mapping[str, Any], cases: Sequence[Case], results: Mapping[str, JobResult]) -> str:
    """The whole page: the template with every placeholder filled from ``run``."""
    measurements = [m for r in results.values() for m in r.measurements]
    verdicts = [evaluate(t, measurements) for t in TARGETS if t.case in results]
    by_id = {v.target.id: v for v in verdicts}
    generated = f"Generated by `{run['command']}` on {run['started']} ({run['duration_s']:.0f} s)."
    for rerun in run.get("reruns", []):
        generated += (
            f" Re-run since then with `{rerun['command']}` on {rerun['started']}: "
            f"{', '.join(rerun['cases'])}"
            + (f" (CPU: {rerun['cpu']})." if rerun.get("cpu") else ".")
        )
    if run["options"].get("quick"):
        generated += (
            "\n\n> **These figures come from a `--quick` smoke run** (few repeats, one seed, short "
            "training) and, unless the load average below is near zero, from a busy machine: "
            "they show that every case runs, not how fast anything is. Regenerate with "
            "`python -m benchmarks --markdown docs/benchmarks.md` on a quiet machine."
        )
    sections = "\n\n".join(
        case_md(i, c, results.get(c.name), run["machine"]) for i, c in enumerate(cases, start=1)
    )
    text = TEMPLATE.read_text()
    fills = {
        "generated": generated,
        "command": run["command"],
        "machine": machine_md(run),
        "cpu": cpu_stamp(run["machine"]),
        "targets": targets_md(verdicts) if verdicts else "_No case with a target was run._",
        "results": sections,
    }
    for key, value in fills.items():
        text = text.replace("{{" + key + "}}", value)

    def target_ref(match: re.Match[str]) -> str:
        v = by_id.get(match.group(1))
        if v is None:
            return "(not run)"
        return f"{v.detail} — **{v.status}**" if v.status != "not measured" else "(not measured)"

    def figure_ref(match: re.Match[str]) -> str:
        case, group, contender, *metric = match.group(1).split("/")
        mine = [m for m in measurements if m.case == case]
        m = find(mine, group, contender, metric[0] if metric else None)
        return f"{fmt(m.value)} {m.unit}" if m is not None and m.ok else "(not measured)"

    text = re.sub(r"\{\{target:([\w-]+)\}\}", target_ref, text)
    text = re.sub(r"\{\{figure:([^}]+)\}\}", figure_ref, text)
    unknown = re.findall(r"\{\{[^}]*\}\}", text)
    if unknown:
        raise ValueError(f"template placeholders the generator does not know: {unknown}")
    return text.rstrip() + "\n"


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
