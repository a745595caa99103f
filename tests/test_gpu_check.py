"""``make gpu-check`` (benchmarks/gpu_check.py): refuses fast without a GPU, finds the CUDA
tests, and reads its steps' results right. Its GPU run itself needs a GPU (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the benchmarks package lives at the repository root
    sys.path.insert(0, str(ROOT))

from benchmarks import gpu_check  # noqa: E402


def test_without_a_gpu_it_says_so_and_fails_at_once() -> None:
    if gpu_check.gpu_present() is not None:
        pytest.skip("this machine has an NVIDIA GPU: `make gpu-check` runs for real here")
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert run.returncode == 2
    assert "no CUDA GPU on this machine" in run.stdout
    assert time.monotonic() - start < 30


def test_every_file_with_cuda_tests_is_run() -> None:
    files = gpu_check.cuda_test_files()
    assert {"tests/torch/test_cuda.py", "tests/torch/test_presets.py"} <= set(files)
    for path in (ROOT / "tests").rglob("test_*.py"):
        marked = "mark.cuda" in path.read_text(encoding="utf-8")
        assert marked == (str(path.relative_to(ROOT)) in files)


def test_junit_counts_name_the_failures(tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.torch.test_cuda" name="test_a"/>'
        '<testcase classname="tests.torch.test_cuda" name="test_b"><failure message="x"/>'
        '</testcase><testcase classname="t" name="c"><skipped message="no bf16"/></testcase>'
        "</testsuite></testsuites>"
    )
    counts = gpu_check.junit_counts(junit)
    assert (counts["tests"], counts["failures"], counts["skipped"]) == (3, 1, 1)
    assert counts["failed"] == ["tests.torch.test_cuda::test_b"]
    assert counts["skip_reasons"] == ["no bf16"]


def test_training_problems_are_errors_and_accuracy_drops(tmp_path: Path) -> None:
    runs = [
        {"policy": "O0", "status": "ok", "test_accuracy": 0.97},
        {"policy": "O2", "status": "ok", "test_accuracy": 0.96},
        {"policy": "O3-bf16", "status": "ok", "test_accuracy": 0.90},
        {"policy": "O1", "status": "error: RuntimeError: boom"},
        {"policy": "O1-bf16", "status": "skipped: no bfloat16 here"},
    ]
    path = tmp_path / "training.json"
    path.write_text(json.dumps({"data": "x", "runs": runs}))
    problems = gpu_check.training_problems(path)
    assert problems == [
        "O1: error: RuntimeError: boom",
        "O3-bf16: test accuracy 0.900, more than 3 points under float32's 0.970",
    ]


def test_the_benchmark_tables_are_the_pages_own(tmp_path: Path) -> None:
    measurement = {
        "case": "cuda", "group": "mlp", "contender": "mixprec O2", "metric": "step",
        "unit": "ms", "samples": [1.0, 1.2], "error": None, "headline": "median", "note": "",
    }  # fmt: skip
    run = {
        "machine": {"cpu": "some CPU"},
        "cases": {"cuda": {"measurements": [measurement], "lines": ["GPU: H100"], "meta": {}}},
    }
    path = tmp_path / "bench-cuda.json"
    path.write_text(json.dumps(run))
    text = gpu_check.bench_md(path)
    assert "- GPU: H100" in text and "| mixprec O2 | step | 1.10 ms (median, n=2)" in text
    assert gpu_check.bench_errors(path) == []
