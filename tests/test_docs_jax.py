"""docs/jax.md's PyTorch half runs here (the JAX plugin's own tests, in .venv-jax, run the
rest: plugins/mixprec-jax/tests/test_docs_jax.py): the policy file the page shares between
JAX and PyTorch drives a wrapped torch model, and the install page lists the jax extra."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

import mixprec

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT / "plugins" / "mixprec-jax" / "examples" / "shared_policy"
INCLUDE = re.compile(r"<!-- include: (\S+) -->\n```(\w+)\n(.*?)```\n<!-- end include -->", re.S)


def test_the_page_shows_the_files_run_here() -> None:
    found = {path: block for path, _, block in INCLUDE.findall((ROOT / "docs/jax.md").read_text())}
    for name in ("policy.toml", "torch_side.py"):
        path = SHARED / name
        assert found[str(path.relative_to(ROOT))] == path.read_text(), f"jax.md is stale: {name}"


def test_the_shared_policy_file_drives_a_torch_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    monkeypatch.chdir(SHARED)
    runpy.run_path(str(SHARED / "torch_side.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "1       LayerNorm  float32   float32   pinned by class rule *LayerNorm*" in out, out
    assert "0       Linear     bfloat16  bfloat16" in out, out
    policy = mixprec.load_toml(SHARED / "policy.toml")
    assert policy.decide("softmax", ["bfloat16"]).dtype == "float32"


def test_the_install_page_lists_the_jax_extra() -> None:
    text = (ROOT / "docs" / "install.md").read_text()
    assert "pip install 'mixprec[jax]' flax" in text
    row = next(line for line in text.splitlines() if line.startswith("| `jax` |"))
    assert "mixprec-jax" in row and "mixprec.jax" in row
    extra = re.search(r"^jax = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert extra is not None and re.fullmatch(r'"mixprec-jax[<>=!~][^"]*"', extra[1]), extra
