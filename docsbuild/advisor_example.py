"""The advisor page's worked example, run at every docs build (so it cannot go stale).

Runs the ``mixprec advise`` commands the page shows, each in its own process as a user
would, and keeps what they print and the plots they write. The results are cached under
``build/docs-cache/`` keyed by a hash of the code that produces them (mixprec, the backends,
the example factories, the commands, the framework versions): a rebuild with unchanged code
reuses them, any change to the code reruns them.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["COMMANDS", "Example", "machine", "run_examples"]

#: backend -> the arguments of ``mixprec`` (``--out`` is added). float16 convolutions are
#: slow on a CPU: O2 is the one float16 candidate, as in ``make demo``.
COMMANDS: dict[str, list[str]] = {
    "torch": [
        "advise", "examples.advise_demo:torch_digits",
        "--candidates", "O1-bf16,O2-bf16,O2", "--steps", "8",
    ],
    "mxnet": ["advise", "examples.advise_demo:mxnet_digits", "--steps", "8"],
}  # fmt: skip
SOURCES = ("mixprec", "backends", "examples/advise_demo.py", "examples/demo.py")
PLOTS = ("time_vs_distance.png", "loss_curves.png", "loss_scale.png", "sensitivity.png")


@dataclass(frozen=True)
class Example:
    """One backend's run: the command as a user types it, what it printed, its folder."""

    backend: str
    command: str
    output: str
    folder: Path


def _versions() -> str:
    found = []
    for dist in ("torch", "mxnet", "numpy"):
        try:
            found.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ", ".join(found)


def machine() -> str:
    """The CPU the example ran on, its bfloat16 features and the framework versions."""
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    features = ", ".join(
        f"{label} {'yes' if flag in flags else 'no'}"
        for label, flag in (("AVX512-BF16", "avx512_bf16"), ("AMX-BF16", "amx_bf16"))
    )
    return f"{model}, {os.cpu_count()} cores ({features}); {_versions()}"


def _key(root: Path) -> str:
    digest = hashlib.sha256(repr((COMMANDS, _versions(), sys.version)).encode())
    for source in SOURCES:
        path = root / source
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for file in files:
            digest.update(str(file.relative_to(root)).encode())
            digest.update(file.read_bytes())
    digest.update(Path(__file__).read_bytes())
    return digest.hexdigest()[:16]


def _run(root: Path, folder: Path, backend: str) -> str:
    out = f"advice/{backend}"
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    )
    env.pop("MIXPREC_DISABLE_PLUGINS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "mixprec", *COMMANDS[backend], "--out", out],
        cwd=folder, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(
            f"the advisor example for {backend} failed (exit {proc.returncode}):\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("mixprec: warning")]
    return "\n".join([*warnings, proc.stdout.rstrip()])


def run_examples(root: Path, cache: Path) -> tuple[str, list[Example]]:
    """``(header, examples)``: run (or reuse) every backend's example under ``cache``."""
    key = _key(root)
    folder = cache / f"advisor-{key}"
    done = folder / "done.txt"
    if not done.is_file():
        if cache.is_dir():
            for old in cache.glob("advisor-*"):
                shutil.rmtree(old, ignore_errors=True)
        folder.mkdir(parents=True, exist_ok=True)
        for backend in COMMANDS:
            (folder / f"{backend}.txt").write_text(_run(root, folder, backend))
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        done.write_text(f"{when} on {machine()}")
    header = done.read_text()
    examples = [
        Example(
            backend=backend,
            command=" ".join(["mixprec", *COMMANDS[backend], "--out", f"advice/{backend}"]),
            output=(folder / f"{backend}.txt").read_text(),
            folder=folder / "advice" / backend,
        )
        for backend in COMMANDS
    ]
    return header, examples
