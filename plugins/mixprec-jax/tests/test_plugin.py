"""The plugin is found through its entry point, like any third-party backend."""

from __future__ import annotations

import subprocess
import sys

import mixprec
from mixprec.kit import list_backends


def test_registered_under_the_mixprec_group_and_reached_through_the_facade() -> None:
    import mixprec.jax as mpj
    import mixprec_jax

    row = next(r for r in list_backends() if r.info.name == "jax")
    assert row.usable and row.plugin == "jax"
    assert mpj.Optimizer is mixprec_jax.Optimizer
    assert mixprec.load_backend("jax") is mixprec_jax


def test_mixprec_backends_lists_jax_with_its_dtypes() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mixprec.cli", "backends"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    block = out[out.index("jax ") :]
    assert "cpu:0: float32, bfloat16, float16" in block
    assert "ops it cannot see (run as promote): add, div, mul, sub" in block


def test_importing_mixprec_and_the_plugin_module_imports_no_jax() -> None:
    code = (
        "import sys, mixprec, mixprec.jax, mixprec_jax.plugin\n"
        "mixprec.list_backends()\n"
        "assert 'jax' not in sys.modules, 'jax imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_plugin_imports_only_the_public_kit() -> None:
    """mixprec_jax imports mixprec's public modules and mixprec.testing, nothing private."""
    import ast
    from pathlib import Path

    import mixprec_jax

    private = []
    for path in Path(mixprec_jax.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            private += [f"{path.name}: {n}" for n in names if n.startswith("mixprec.") and
                        any(part.startswith("_") for part in n.split("."))]  # fmt: skip
    assert not private
