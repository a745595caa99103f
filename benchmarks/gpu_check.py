"""``make gpu-check``: the checks that need a CUDA GPU, in one run, into one report folder.

On a machine with a CUDA GPU this runs, within about 8 minutes on one H100:

1. every CUDA-marked test (``pytest -m cuda`` over the test files that carry the marker):
   values, backward, loss scaling, masters and checkpoints on the device, the advisor there,
   and whether the fake-CUDA simulation of ``make test`` gives the device's dtypes;
2. the CUDA benchmark case (``python -m benchmarks --only cuda``): float16 O1/O2 against
   autocast + GradScaler, bfloat16 O2/O3/O3-kahan against autocast;
3. a short end-to-end training (sklearn's digits, 5 epochs) under every GPU preset, with
   test accuracy, loss, skipped steps and time per policy;

and writes ``build/gpu-check/``: ``summary.md`` (read this first), ``env.json``,
``junit.xml`` and ``pytest.log``, ``bench-cuda.json`` and ``bench.log``, ``training.json``.
Exit status: 0 when every step passed, 1 when one failed, 2 at once when there is no CUDA
GPU or no torch that sees one (the message says which, and the fix).

Which Python: ``$GPU_CHECK_PYTHON``, else ``.venv/bin/python`` (what ``make test`` builds: on
a GPU machine with a package registry, ``pip install torch==2.13.0`` installs the CUDA
build), else ``python3``: the first whose torch sees a CUDA device. A Python without
mixprec (a GPU image's own) gets this tree installed into ``build/gpu-check/site`` with
``pip --target --no-deps --no-index`` (no registry needed; pluggy and pytest must be there).
When none sees a GPU and there is no ``.venv``, ``make install`` is tried first.

This file uses the standard library only; the training runs in the chosen Python as
``gpu_check.py --train OUT.json``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "gpu-check"
BUDGET_S = 450.0  # the whole run stays under 8 minutes on one H100
#: step -> its own limit in seconds (each also stops at the overall budget)
LIMITS = {"install": 120.0, "tests": 270.0, "benchmark": 170.0, "training": 120.0}
TRAIN_POLICIES = (
    "O0",
    "torch-autocast-cuda",
    "O1",
    "O2",
    "O1-bf16",
    "O2-bf16",
    "O3-bf16",
    "O3-bf16-kahan",
    "O3-bf16-sr",
)
_PROBE = (
    "import json, torch; print(json.dumps({'torch': torch.__version__, 'cuda': "
    "torch.version.cuda, 'available': torch.cuda.is_available(), 'devices': "
    "[torch.cuda.get_device_name(i) + ' (compute capability ' + "
    "'.'.join(map(str, torch.cuda.get_device_capability(i))) + ')' "
    "for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []}))"
)


def say(message: str) -> None:
    print(f"gpu-check: {message}", flush=True)


# ------------------------------------------------------------------------ finding a GPU


def gpu_present() -> str | None:
    """What says there is an NVIDIA GPU here (``nvidia-smi -L``, the driver), or None."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            listed = subprocess.run(
                [smi, "-L"], capture_output=True, text=True, timeout=30, check=False
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            listed = ""
        if "GPU" in listed:
            return listed
    if Path("/proc/driver/nvidia/gpus").is_dir() or Path("/dev/nvidia0").exists():
        return "an NVIDIA driver and device node (nvidia-smi gave no list)"
    return None


def probe_python(python: str) -> dict[str, Any]:
    """What ``python``'s torch says about CUDA (``{"error": ...}`` when it has none)."""
    try:
        run = subprocess.run(
            [python, "-c", _PROBE], capture_output=True, text=True, timeout=180, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if run.returncode != 0:
        return {"error": (run.stderr.strip().splitlines() or ["no output"])[-1]}
    return dict(json.loads(run.stdout.strip().splitlines()[-1]))


def candidates() -> list[str]:
    named = os.environ.get("GPU_CHECK_PYTHON")
    if named:
        return [named]
    found = [str(ROOT / ".venv" / "bin" / "python")]
    found += [p for p in (shutil.which("python3"), sys.executable) if p and p not in found]
    return [p for p in found if Path(p).exists()]


def choose_python(tried: dict[str, dict[str, Any]]) -> str | None:
    for python in candidates():
        if python not in tried:
            tried[python] = probe_python(python)
        if tried[python].get("available"):
            return python
    return None


def has_mixprec(python: str, env: dict[str, str]) -> bool:
    code = "import mixprec_torch, mixprec.torch, pluggy, pytest"
    return subprocess.run([python, "-c", code], env=env, capture_output=True).returncode == 0


def install_into_site(python: str, env: dict[str, str]) -> tuple[bool, str]:
    """This tree (and the NumPy plugin) into ``build/gpu-check/site``, without a registry."""
    site = OUT / "site"
    shutil.rmtree(site, ignore_errors=True)
    cmd = [python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"]
    cmd += ["--no-build-isolation", "--target", str(site), ".", "./plugins/mixprec-numpy"]
    try:
        run = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=LIMITS["install"], check=False
        )
    except subprocess.TimeoutExpired:
        return False, "pip install --target timed out"
    if run.returncode != 0:
        return False, (run.stderr.strip().splitlines() or ["pip failed"])[-1]
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")])
    if not has_mixprec(python, env):
        return False, "installed, but mixprec_torch, pluggy or pytest does not import"
    return True, f"installed this tree into {site.relative_to(ROOT)}"


# ------------------------------------------------------------------------------ the steps


class Steps:
    """Runs each step as a child process under its limit and the overall budget."""

    def __init__(self, python: str, env: dict[str, str]) -> None:
        self.python, self.env = python, env
        self.started = time.monotonic()
        self.rows: list[dict[str, Any]] = []

    def run(self, name: str, args: list[str], log: Path) -> int | None:
        left = BUDGET_S - (time.monotonic() - self.started)
        limit = max(10.0, min(LIMITS[name], left))
        say(f"{name}: {' '.join(args)} (up to {limit:.0f} s)")
        start = time.monotonic()
        with log.open("w") as out:
            try:
                rc: int | None = subprocess.run(
                    [self.python, *args], cwd=ROOT, env=self.env, stdout=out,
                    stderr=subprocess.STDOUT, timeout=limit, check=False,
                ).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                rc = None
        self.rows.append(
            {"step": name, "rc": rc, "seconds": round(time.monotonic() - start, 1), "log": log.name}
        )
        return rc


def cuda_test_files() -> list[str]:
    """Every test file that carries the ``cuda`` marker (new ones are found by themselves)."""
    files = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if "mark.cuda" in text:
            files.append(str(path.relative_to(ROOT)))
    return files


def junit_counts(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"error": "no junit.xml"}
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {"error": "no testsuite in junit.xml"}
    counts = {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    skipped = sorted({(s.get("message") or "").strip() for s in suite.iter("skipped")} - {""})
    return {**counts, "failed": failed, "skip_reasons": skipped}


def bench_errors(path: Path) -> list[str]:
    if not path.exists():
        return ["no bench-cuda.json"]
    run = json.loads(path.read_text())
    case = run.get("cases", {}).get("cuda", {})
    errors = [
        f"{m['group']} / {m['contender']}: {m['error']}"
        for m in case.get("measurements", [])
        if m.get("error")
    ]
    if not case.get("measurements"):
        errors.append("no measurements: " + "; ".join(case.get("lines", [])))
    return errors


# ------------------------------------------------------------------------------ training


def train(out: Path) -> int:
    """Worker: the digits classifier for 5 epochs on cuda under each policy (chosen Python)."""
    import torch
    from torch import nn

    import mixprec.torch as mpt

    try:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
        y = torch.tensor(digits.target)
        data = "sklearn digits (1797 × 64, 10 classes)"
    except ImportError:  # no sklearn: a synthetic problem of the same shape
        gen = torch.Generator().manual_seed(0)
        centers = torch.randn(10, 64, generator=gen)
        y = torch.randint(0, 10, (1797,), generator=gen)
        x = centers[y] + 0.8 * torch.randn(1797, 64, generator=gen)
        data = "synthetic (no sklearn): 1797 × 64, 10 Gaussian classes"
    x, y = x.cuda(), y.cuda()
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1)).cuda()
    train_idx, test_idx = order[:1400], order[1400:]
    bf16 = torch.cuda.get_device_capability(0) >= (8, 0)
    results: dict[str, Any] = {"data": data, "runs": []}
    for policy in TRAIN_POLICIES:
        if "bf16" in policy and not bf16:
            results["runs"].append({"policy": policy, "status": "skipped: no bfloat16 here"})
            continue
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 10)
        ).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        row: dict[str, Any] = {"policy": policy}
        try:
            model, opt = mpt.wrap(model, opt, policy=policy, seed=0)
            torch.cuda.synchronize()
            start = time.perf_counter()
            losses = []
            for epoch in range(5):
                gen = torch.Generator().manual_seed(epoch)
                shuffled = torch.randperm(len(train_idx), generator=gen).to(train_idx.device)
                for chunk in train_idx[shuffled].split(64):
                    opt.zero_grad()
                    loss = nn.functional.cross_entropy(model(x[chunk]).float(), y[chunk])
                    with mpt.scale_loss(loss, opt) as scaled:
                        scaled.backward()
                    opt.step()
                losses.append(loss.item())
            torch.cuda.synchronize()
            model.eval()
            with torch.no_grad():
                accuracy = (model(x[test_idx]).argmax(1) == y[test_idx]).float().mean().item()
            state = mpt.state(opt)
            row.update(
                status="ok",
                resolved=str(state.policy),
                seconds=round(time.perf_counter() - start, 2),
                epoch_losses=[round(v, 4) for v in losses],
                test_accuracy=round(accuracy, 4),
                skipped_steps=state.skipped_steps,
                loss_scale=state.loss_scale,
            )
        except Exception as exc:  # one policy failing must not hide the others
            row.update(status=f"error: {type(exc).__name__}: {exc}"[:300])
        results["runs"].append(row)
        print(json.dumps(row), flush=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


def training_problems(path: Path) -> list[str]:
    if not path.exists():
        return ["no training.json"]
    runs = json.loads(path.read_text())["runs"]
    base = next((r for r in runs if r["policy"] == "O0" and r["status"] == "ok"), None)
    problems = [f"{r['policy']}: {r['status']}" for r in runs if r["status"].startswith("error")]
    if base is None:
        return [*problems, "O0 did not train"]
    for r in runs:
        if r["status"] == "ok" and r["test_accuracy"] < base["test_accuracy"] - 0.03:
            problems.append(
                f"{r['policy']}: test accuracy {r['test_accuracy']:.3f}, more than 3 points "
                f"under float32's {base['test_accuracy']:.3f}"
            )
    return problems


# -------------------------------------------------------------------------------- report


def bench_md(path: Path) -> str:
    """The CUDA case's tables as docs/benchmarks.md shows them (the runner's own renderer)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks import cuda, report  # stdlib-only modules: no framework is imported
    from benchmarks.runner import JobResult

    run = json.loads(path.read_text())
    result = JobResult.from_dict(run["cases"]["cuda"])
    return report.case_md(8, cuda.CASE, result, run.get("machine")).split("\n", 1)[1].strip()


def summary(env_info: dict[str, Any], steps: Steps, verdicts: dict[str, list[str]]) -> str:
    ok = all(not v for v in verdicts.values())
    lines = [
        "# gpu-check",
        "",
        f"**{'PASSED' if ok else 'FAILED'}** — {env_info['date']}, git {env_info['git']}",
        "",
        f"- GPU: {', '.join(env_info['torch'].get('devices', [])) or 'none'}",
        f"- torch {env_info['torch'].get('torch')}, CUDA {env_info['torch'].get('cuda')}, "
        f"Python {env_info['python']}",
        f"- how mixprec was found: {env_info['mixprec']}",
        "",
        "| step | result | seconds | log |",
        "|---|---|---|---|",
    ]
    for row in steps.rows:
        problems = verdicts.get(row["step"], [])
        result = "timed out" if row["rc"] is None else ("ok" if not problems else "FAILED")
        lines.append(f"| {row['step']} | {result} | {row['seconds']} | `{row['log']}` |")
    lines.append("")
    counts = env_info.get("tests", {})
    if counts:
        lines += [
            "## CUDA tests",
            "",
            f"{counts.get('tests', 0)} tests: {counts.get('failures', 0)} failed, "
            f"{counts.get('errors', 0)} errors, {counts.get('skipped', 0)} skipped "
            f"(files: {', '.join(env_info.get('test_files', []))}).",
            "",
        ]
        lines += [f"- FAILED {name}" for name in counts.get("failed", [])]
        lines += [f"- skipped: {reason}" for reason in counts.get("skip_reasons", [])]
        lines.append("")
    bench = OUT / "bench-cuda.json"
    if bench.exists():
        lines += ["## CUDA benchmark (`python -m benchmarks --only cuda`)", "", bench_md(bench), ""]
    training = OUT / "training.json"
    if training.exists():
        data = json.loads(training.read_text())
        lines += [
            f"## Training: {data['data']}, 5 epochs, AdamW, batch 64",
            "",
            "| policy | resolved | test accuracy | last epoch loss | skipped | seconds |",
            "|---|---|---|---|---|---|",
        ]
        for r in data["runs"]:
            if r["status"] != "ok":
                lines.append(f"| {r['policy']} | {r['status']} | | | | |")
                continue
            lines.append(
                f"| {r['policy']} | {r['resolved']} | {r['test_accuracy']:.3f} | "
                f"{r['epoch_losses'][-1]} | {r['skipped_steps']} | {r['seconds']} |"
            )
        lines.append("")
    for step, problems in verdicts.items():
        if problems:
            lines += [f"## Problems: {step}", "", *[f"- {p}" for p in problems], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make gpu-check", description=__doc__.split("\n")[0])
    parser.add_argument("--train", type=Path, metavar="OUT.json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.train:
        return train(args.train)

    gpu = gpu_present()
    if gpu is None:
        say(
            "no CUDA GPU on this machine (no nvidia-smi GPU, no /dev/nvidia0): nothing to "
            "check. Run `make gpu-check` where one is; `make test` checks the CUDA paths that "
            "can be checked without one (tests/torch/test_fake_cuda.py)."
        )
        return 2
    say(f"GPU: {gpu.splitlines()[0]}")
    tried: dict[str, dict[str, Any]] = {}
    python = choose_python(tried)
    if python is None and not (ROOT / ".venv").exists() and "GPU_CHECK_PYTHON" not in os.environ:
        say("no Python here has a torch that sees the GPU; trying `make install` (as make test)")
        subprocess.run(["make", "install"], cwd=ROOT, check=False)
        tried.pop(str(ROOT / ".venv" / "bin" / "python"), None)
        python = choose_python(tried)
    if python is None:
        for name, info in tried.items():
            say(f"  {name}: {info}")
        say(
            "no torch that sees the GPU. A CPU build of torch (2.13.0+cpu) cannot use it: "
            "install the CUDA build into the venv (.venv/bin/pip install torch==2.13.0 from "
            "PyPI or https://download.pytorch.org/whl/cu126), or point GPU_CHECK_PYTHON at a "
            "Python whose torch has CUDA"
        )
        return 2
    OUT.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    how = f"{python} (mixprec already installed)"
    if not has_mixprec(python, env):
        installed, why = install_into_site(python, env)
        if not installed:
            say(f"cannot install mixprec for {python}: {why}")
            return 2
        how = f"{python}; {why}"
    say(f"using {how}")
    info = tried[python]
    try:  # a copy of the tree may come without git or its .git folder
        git = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        git = ""
    version = subprocess.run(
        [python, "-c", "import platform; print(platform.python_version())"],
        capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    env_info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "git": git or "unknown",
        "python": version,
        "torch": info,
        "mixprec": how,
        "nvidia-smi": gpu,
    }
    steps = Steps(python, env)
    verdicts: dict[str, list[str]] = {}

    files = cuda_test_files()
    env_info["test_files"] = files
    junit = OUT / "junit.xml"
    junit.unlink(missing_ok=True)
    rc = steps.run(
        "tests",
        ["-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", "--continue-on-collection-errors",
         f"--junitxml={junit}", *files],
        OUT / "pytest.log",
    )  # fmt: skip
    counts = junit_counts(junit)
    env_info["tests"] = counts
    verdicts["tests"] = (
        ["timed out"] if rc is None else [f"pytest exit status {rc}"] if rc != 0 else []
    ) + [f"FAILED {name}" for name in counts.get("failed", [])]

    bench = OUT / "bench-cuda.json"
    bench.unlink(missing_ok=True)
    rc = steps.run(
        "benchmark",
        ["-m", "benchmarks", "--only", "cuda", "--threads", "4", "--timeout",
         str(LIMITS["benchmark"] - 10), "--json", str(bench)],
        OUT / "bench.log",
    )  # fmt: skip
    verdicts["benchmark"] = (["timed out"] if rc is None else []) + bench_errors(bench)

    training = OUT / "training.json"
    training.unlink(missing_ok=True)
    rc = steps.run(
        "training", [str(Path(__file__).resolve()), "--train", str(training)], OUT / "train.log"
    )
    verdicts["training"] = (["timed out"] if rc is None else []) + training_problems(training)

    (OUT / "env.json").write_text(json.dumps(env_info, indent=1) + "\n")
    text = summary(env_info, steps, verdicts)
    (OUT / "summary.md").write_text(text + "\n")
    print(text)
    failed = [step for step, problems in verdicts.items() if problems]
    say(f"{'FAILED: ' + ', '.join(failed) if failed else 'passed'}; report in {OUT}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
