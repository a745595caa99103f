"""The mixprec console script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mixprec import plugins
from mixprec.advise_cli import split_candidates
from mixprec.cli import main
from mixprec.errors import AdviceError
from mixprec.presets import DTYPE_ROLES, builtin_preset_names
from mixprec.spec import get_policy


def test_policies_prints_every_preset_with_roles_and_lists(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    blocks = {block.split("\n", 1)[0]: block for block in out.split("\n\n")}
    assert list(blocks) == builtin_preset_names()
    for name, block in blocks.items():
        policy = get_policy(name)
        roles = ", ".join(f"{r}={getattr(policy, r) or '-'}" for r in DTYPE_ROLES)
        assert f"\n  {roles}\n  loss_scale=" in block, block
        for list_name in ("lowp", "fp32", "promote", "banned"):
            ops = sorted(getattr(policy.ops, list_name))
            assert (f"  {list_name:<8} {', '.join(ops)}" in block) == bool(ops), block
    assert "param=float16, compute=float16, output=float32, master=float32" in out  # O2
    assert "fp32     " in out and "softmax" in out
    assert "class:*BatchNorm* -> float32" in out


def test_explain_names_the_deciding_rule(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "O1-bf16", "softmax", "--inputs", "bfloat16"]) == 0
    assert "Result: float32, by global fp32 list" in capsys.readouterr().out


def test_bad_input_is_an_error_message_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "O7", "softmax"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mixprec: error: ") and "O1" in err


def test_backends_lists_broken_plugins(capsys: pytest.CaptureFixture[str]) -> None:
    plugins.reset()
    try:
        plugins._broken["broken-demo"] = "ImportError: no module named broken_demo"
        assert main(["backends", "--no-capabilities"]) == 0
    finally:
        plugins.reset()
    out = capsys.readouterr().out
    assert "torch" in out and "mxnet" in out
    assert "broken plugins:\n  broken-demo: ImportError" in out


def test_backends_names_the_plugins_the_variable_disables(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(plugins.DISABLE_ENV, "mxnet")
    plugins.reset()
    try:
        assert main(["backends", "--no-capabilities"]) == 0
    finally:
        plugins.reset()
    out = capsys.readouterr().out
    assert "disabled by MIXPREC_DISABLE_PLUGINS: mxnet" in out


@pytest.mark.slow
def test_backends_reports_versions_and_capabilities() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mixprec.cli", "backends"],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    import mxnet
    import torch

    assert f"torch {torch.__version__.split('+')[0]}" in out
    assert f"mxnet {mxnet.__version__}" in out
    assert "cpu: float32" in out and "bfloat16" in out


# ---------------------------------------------------------------------- issue 21


def test_explain_of_a_hostile_policy_file_is_an_error_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``mixprec explain`` printed an AttributeError traceback for ``base = 5``."""
    for text in ("base = 5\n", "ops = " + "[" * 5000 + "]" * 5000 + "\n"):
        path = tmp_path / "hostile.toml"
        path.write_text(text, encoding="utf-8")
        assert main(["explain", str(path), "softmax"]) == 2
        assert capsys.readouterr().err.startswith("mixprec: error: ")
    path.write_bytes(b"\xff\xfe")
    assert main(["explain", str(path), "softmax"]) == 2
    assert "not UTF-8" in capsys.readouterr().err


def test_explain_refuses_an_unknown_input_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "O2", "linear", "--inputs", "float99"]) == 2
    assert "unknown dtype 'float99'" in capsys.readouterr().err
    assert main(["explain", "O2-bf16", "add", "--inputs", "bf16, fp32"]) == 0
    assert "float32" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("given", "policies"),
    [
        ("O1-bf16,O2-bf16", ["O1-bf16", "O2-bf16"]),
        ("base=O2-bf16,compute=bfloat16", ["base=O2-bf16,compute=bfloat16"]),
        ("O2-bf16,output=bfloat16", ["O2-bf16,output=bfloat16"]),
        ("O1-bf16;base=O2-bf16,compute=bfloat16", ["O1-bf16", "base=O2-bf16,compute=bfloat16"]),
        ("mine.toml, O1 ;", ["mine.toml", "O1"]),
        (
            "path:head=float32(fp32=softmax,lowp=bmm),O1",
            ["path:head=float32(fp32=softmax,lowp=bmm)", "O1"],
        ),
    ],
)
def test_advise_candidates_keep_a_key_grammar_policy_whole(given: str, policies: list[str]) -> None:
    """``--candidates "base=O2-bf16,compute=bfloat16"`` was split on the comma into two
    policies, and a policy nobody asked for was recommended."""
    assert split_candidates(given) == policies
    for policy in policies:
        if not policy.endswith(".toml"):
            get_policy(policy)  # each one is a policy


def test_advise_candidates_that_name_nothing_are_refused() -> None:
    with pytest.raises(AdviceError, match="names no policy"):
        split_candidates(" ; ,")
