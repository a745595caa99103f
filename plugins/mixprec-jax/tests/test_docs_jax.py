"""docs/jax.md and the READMEs' JAX snippets run as written (issue 36): the page's blocks are
the example files, each file runs here, and its shell commands are the ones test_install.py
runs in fresh environments."""

from __future__ import annotations

import importlib
import inspect
import re
import runpy
import textwrap
from pathlib import Path

import jax
import pytest

import mixprec
from tests import _page


def test_every_block_is_an_included_file_or_a_tested_command() -> None:
    found = _page.includes()
    assert [path for path, _, _ in found] == _page.INCLUDED
    for path, language, block in found:
        assert language == {".py": "python", ".toml": "toml"}[Path(path).suffix], path
        assert block == (_page.ROOT / path).read_text(encoding="utf-8"), f"jax.md is stale: {path}"
    included = {block for _, _, block in found}
    for language, block in _page.fences():
        assert block in included or language == "sh", f"an untested {language} block:\n{block}"
    assert _page.commands() == _page.COMMANDS


def test_the_first_loop_runs_in_bfloat16(capsys: pytest.CaptureFixture[str]) -> None:
    ns = runpy.run_path(str(_page.EXAMPLES / "quickstart.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert out.startswith("loss ") and out.endswith("skipped steps 0\n"), out
    assert float(out.split()[1].rstrip(",")) < 0.5  # it learns
    opt, state = ns["opt"], ns["state"]
    assert {str(w.dtype) for w in jax.tree_util.tree_leaves(state.weights)} == {"float32"}
    forward = jax.tree_util.tree_leaves(opt.model_params(state))
    assert {str(w.dtype) for w in forward} == {"bfloat16"}
    report = opt.dtype_report(state)
    assert report.count("Dense  bfloat16  bfloat16") == 2, report


@pytest.mark.skipif(jax.device_count() < 2, reason="needs two (host) devices (conftest.py)")
def test_the_multi_device_loop_runs_on_two_devices(capsys: pytest.CaptureFixture[str]) -> None:
    runpy.run_path(str(_page.EXAMPLES / "multi_device.py"), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["pmap, 2 device(s)", "shard_map, 2 device(s)"]
    assert all(line.endswith("skipped 0") for line in lines), lines
    pmap_loss, shard_loss = (float(line.split("loss ")[1].split(",")[0]) for line in lines)
    assert pmap_loss == pytest.approx(shard_loss, abs=2e-3)  # the same step, two ways


def test_the_shared_policy_file_drives_the_jax_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _page.EXAMPLES / "shared_policy"
    monkeypatch.chdir(folder)
    runpy.run_path(str(folder / "jax_side.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert out.startswith("Result: float32, by global fp32 list\n"), out
    assert "layers_1  LayerNorm  float32   float32   pinned by class rule *LayerNorm*" in out
    assert "layers_0  Dense      bfloat16  bfloat16" in out
    policy = mixprec.load_toml(folder / "policy.toml")
    assert policy.name == "shared-bf16" and policy.compute == "bfloat16"


def _block(readme: Path, heading: str | None) -> str:
    text = readme.read_text(encoding="utf-8")
    if heading is not None:
        text = text.split(f"## {heading}", 1)[1]
    return text.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.parametrize(
    ("readme", "heading"),
    [("README.md", "JAX (optax and flax)"), ("plugins/mixprec-jax/README.md", None)],
)
def test_the_readme_snippet_runs_as_written(readme: str, heading: str | None) -> None:
    """Nothing injected: the names it uses are its own (the old one had three undefined)."""
    namespace: dict[str, object] = {}
    exec(compile(_block(_page.ROOT / readme, heading), readme, "exec"), namespace)
    info = namespace["info"]
    assert not bool(info.skipped)  # type: ignore[attr-defined]
    masters = jax.tree_util.tree_leaves(namespace["params"])
    assert {str(p.dtype) for p in masters} == {"float32"}


REFERENCE = _page.ROOT / "docs" / "reference" / "jax.md"


def test_every_public_name_is_on_the_reference_page() -> None:
    import mixprec_jax

    targets = re.findall(r"^::: mixprec_jax\.(\w+)$", REFERENCE.read_text(encoding="utf-8"), re.M)
    assert len(targets) == len(set(targets)), targets
    missing = sorted(set(mixprec_jax.__all__) - set(targets))
    assert not missing, f"docs/reference/jax.md lacks {missing}"
    for name in targets:  # and each one resolves (a module of the package, or a name)
        assert hasattr(mixprec_jax, name) or importlib.import_module(f"mixprec_jax.{name}")


def _examples(doc: str) -> list[str]:
    """The literal blocks that follow an ``Example::`` line."""
    lines, blocks = inspect.cleandoc(doc).splitlines(), []
    for i, line in enumerate(lines):
        if line.strip() != "Example::":
            continue
        indent = len(line) - len(line.lstrip())
        block = []
        for row in lines[i + 1 :]:
            if row.strip() and len(row) - len(row.lstrip()) <= indent:
                break
            block.append(row)
        blocks.append(textwrap.dedent("\n".join(block)).strip() + "\n")
    return blocks


@pytest.mark.parametrize("name", sorted(__import__("mixprec_jax").__all__))
def test_every_public_name_has_an_example_that_runs(name: str) -> None:
    import mixprec_jax

    examples = _examples(getattr(mixprec_jax, name).__doc__ or "")
    assert examples, f"mixprec_jax.{name} has no 'Example::' in its docstring"
    for example in examples:
        exec(compile(example, f"mixprec_jax.{name}'s example", "exec"), {})
