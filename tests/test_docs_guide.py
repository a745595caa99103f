"""The user guide and README stay true: included examples match their files, and run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The Gluon bfloat16 island warning, as a -W filter (it matches a prefix of the message).
ISLANDS = "ignore:no bfloat16 kernel on this CPU"
INCLUDE = re.compile(r"<!-- include: (\S+) -->\n```python\n(.*?)```\n<!-- end include -->", re.S)


def includes(page: str) -> list[tuple[str, str]]:
    return INCLUDE.findall((ROOT / page).read_text())


def test_guide_includes_match_their_files() -> None:
    found = includes("docs/guide.md")
    assert {path for path, _ in found} == {
        "examples/torch_loop.py",
        "examples/gluon_loop.py",
        "examples/lightning_digits.py",  # run by tests/torch/test_lightning_closures.py
        "examples/accelerate_loop.py",  # run by tests/torch/test_accelerate.py
    }
    for path, text in found:
        assert text == (ROOT / path).read_text(), f"docs/guide.md is out of date with {path}"


@pytest.mark.slow
@pytest.mark.parametrize("example", ["examples/torch_loop.py", "examples/gluon_loop.py"])
def test_example_runs(example: str) -> None:
    proc = subprocess.run(
        # the Gluon bfloat16 island warning (CPUs without AVX512-BF16) is not an error here:
        # tests/mxnet/test_mx_islands.py asserts it
        [sys.executable, "-W", "error::UserWarning", "-W", ISLANDS, str(ROOT / example)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train accuracy" in proc.stdout


def test_readme_policy_example_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Policies", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(block, "README.md#policies", "exec"), {})


def _readme_block(heading: str) -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split(f"## {heading}", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_readme_pytorch_example_runs() -> None:
    import torch

    torch.manual_seed(0)
    loader = [(torch.randn(32, 64), torch.randint(0, 10, (32,))) for _ in range(3)]
    exec(compile(_readme_block("PyTorch"), "README.md#pytorch", "exec"), {"loader": loader})


@pytest.mark.slow
def test_readme_gluon_example_runs() -> None:
    import mxnet as mx

    batches = [(mx.nd.random.normal(shape=(32, 64)), mx.nd.array([i % 10 for i in range(32)]))]
    exec(compile(_readme_block("MXNet Gluon"), "README.md#gluon", "exec"), {"batches": batches})


def test_demo_runs_a_backend_and_reports_each_policy() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples/demo.py"), "--backend", "numpy"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, check=True,
    )  # fmt: skip
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [row["policy"] for row in rows] == ["O0", "O1", "O2", "O2-bf16"]
    assert all(row["accuracy"] > 0.95 and not row["note"] for row in rows)
