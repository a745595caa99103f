"""The mixprec console script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import mixprec
from mixprec.advisor.command import split_candidates
from mixprec.cli import build_parser, main
from mixprec.cli_format import cli_messages
from mixprec.engine import plugins
from mixprec.engine.spec import get_policy, preset_names
from mixprec.errors import AdviceError, MixprecWarning
from mixprec.policy.presets import DTYPE_ROLES, builtin_preset_names


def test_policies_prints_every_preset_with_roles_and_lists(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    blocks = {block.split()[0]: block for block in out.split("\n\n")}
    assert list(blocks) == preset_names()  # every name get_policy accepts, in its order
    for name in set(preset_names()) - set(builtin_preset_names()):  # torch-autocast*
        assert blocks[name].startswith(f"{name}  (from the torch plugin)\n"), blocks[name]
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


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run ``mixprec argv``, which must fail with exit status 2 and one line on stderr."""
    try:
        status = main(argv)
    except SystemExit as exit_:  # argparse's own mistakes leave through exit()
        status = exit_.code
    captured = capsys.readouterr()
    assert status == 2, captured
    assert captured.err.startswith("mixprec: error: "), captured.err
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err
    return captured.err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["explain", "O1", "softmax", "--inputs", "flaot16"], "Did you mean 'float16'"),
        (["explain", "O1", "softmax", "--inputs", "float16,"], "empty dtype"),
        (["advise", "examples.advise_demo:torch_digits", "--steps", "0"], "at least 1, got '0'"),
        (["advise", "examples.advise_demo:torch_digits", "--steps", "many"], "at least 1"),
        (["advise", "json:dumps"], "json:dumps() raised TypeError"),
        (["advise", "json"], "expected module:factory"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["explain", "O1"], "the following arguments are required: op"),
        (["policies", "O9"], "unknown policy preset 'O9'"),
    ],
)
def test_argument_mistakes_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    err = _one_line_error(capsys, argv)
    assert says in err
    assert "steps=" not in err  # CLI messages speak CLI, not Python keyword arguments


def test_explain_takes_integer_inputs_and_canonical_spellings(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["explain", "O1", "add", "--inputs", "fp16,int64,torch.float32"]) == 0
    out = capsys.readouterr().out
    assert "(inputs float16, int64, float32)" in out
    assert "Result: float32" in out  # promote: the widest floating input


def test_bare_mixprec_prints_help_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: mixprec")
    for command in ("policies", "explain", "backends", "advise"):
        assert f"\n  mixprec {command} " in out  # one example each


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"mixprec {mixprec.__version__}\n"


def test_every_command_help_shows_an_example() -> None:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    assert set(sub.choices) >= {"policies", "explain", "backends", "advise"}
    for name, command in sub.choices.items():
        text = command.format_help()
        assert f"examples:\n  mixprec {name}" in text, text


def test_python_dash_m_mixprec_is_the_command() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mixprec", "explain", "O1", "softmax", "--inputs", "flaot16"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.startswith("mixprec: error: argument --inputs: unknown dtype 'flaot16'")
    version = subprocess.run(
        [sys.executable, "-m", "mixprec", "--version"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert version.stdout.strip() == f"mixprec {mixprec.__version__}"


def test_warnings_print_as_one_mixprec_line(capsys: pytest.CaptureFixture[str]) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("always")  # pytest turns warnings into errors; a shell does not
        with cli_messages():
            warnings.warn("bfloat16 is slow here", MixprecWarning, stacklevel=1)
            warnings.warn("a library's note", UserWarning, stacklevel=1)
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "mixprec: warning: bfloat16 is slow here",
        "mixprec: warning: UserWarning: a library's note",
    ]


_CTRL_C_IN_A_FINALISER = """
import gc, signal, time
from mixprec.cli_format import cli_messages


class Finalised:
    def __del__(self):
        signal.raise_signal(signal.SIGINT)  # Ctrl-C while the collector runs this


def run():
    cycle = Finalised()
    cycle.self = cycle
    del cycle
    gc.collect()
    end = time.monotonic() + 60
    while time.monotonic() < end:  # the rest of the command: it must not run to its end
        pass
    print("ran to the end")
    return 0


with cli_messages() as report:
    raise SystemExit(report(run))
"""


def _ctrl_c_reaches_python() -> None:
    """In the child before it runs: Ctrl-C as in a terminal. A child inherits an ignored
    or blocked SIGINT (a suite started in the background, ``make test &``, ignores it; a
    clean clone's CI run of the whole suite once saw both Ctrl-C tests run to exit 0)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def test_ctrl_c_inside_a_finaliser_still_interrupts(tmp_path: Path) -> None:
    """CI: a Ctrl-C that landed in a weakref callback was printed as "Exception ignored" with
    a traceback, and ``mixprec advise`` ran on to exit 0."""
    import subprocess
    import sys

    script = tmp_path / "finaliser.py"
    script.write_text(_CTRL_C_IN_A_FINALISER)
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True, text=True, timeout=120, preexec_fn=_ctrl_c_reaches_python,
    )  # fmt: skip
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.splitlines() == ["mixprec: interrupted"], proc.stderr
    assert "ran to the end" not in proc.stdout


# ---------------------------------------------------------------------- issue 37


@pytest.mark.parametrize(
    ("argv", "close"),
    [
        (["bakends"], "'backends'"),
        (["polcies"], "'policies'"),
        (["lock", "O1", "--backend", "numpy", "--device", "cdua"], "'cuda'"),
    ],
)
def test_a_misspelt_command_or_choice_says_the_close_match(
    capsys: pytest.CaptureFixture[str], argv: list[str], close: str
) -> None:
    """Issue 36 item 4: ``mixprec bakends`` -> "did you mean 'backends'?"."""
    err = _one_line_error(capsys, argv)
    assert f"did you mean {close}?" in err and "(choose from " in err


def test_a_choice_with_no_close_match_says_no_guess(capsys: pytest.CaptureFixture[str]) -> None:
    err = _one_line_error(capsys, ["frobnicate"])
    assert "did you mean" not in err and "invalid choice: 'frobnicate'" in err


_SLOW_FACTORY = """
import pathlib, time
from collections.abc import Sequence

import torch


class SlowBatches(Sequence):
    # one batch, slow to fetch: the advisor is running when Ctrl-C lands

    def __len__(self):
        return 1

    def __getitem__(self, index):
        if not isinstance(index, int) or index not in (0, -1):
            raise IndexError(index)
        pathlib.Path("running").touch()
        time.sleep(0.05)
        return torch.randn(8, 4), torch.randint(0, 2, (8,))


def factory():
    model = torch.nn.Linear(4, 2)
    make_optimizer = lambda params: torch.optim.SGD(params, lr=0.1)
    return model, make_optimizer, SlowBatches(), torch.nn.functional.cross_entropy
"""


@pytest.mark.torch
def test_ctrl_c_in_advise_exits_130_with_one_line(tmp_path: Path) -> None:
    """Ctrl-C in ``mixprec advise`` printed a 50-line traceback: run as found, a command
    interrupted (SIGINT) while it runs."""
    import signal
    import subprocess
    import sys
    import time

    pytest.importorskip("torch")
    (tmp_path / "slow_advice.py").write_text(_SLOW_FACTORY)
    child = subprocess.Popen(
        [sys.executable, "-m", "mixprec", "advise", "slow_advice:factory", "--steps", "1000",
         "--candidates", "O1-bf16", "--out", str(tmp_path / "out")],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_ctrl_c_reaches_python,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "running").exists():
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "the advisor never started"
            time.sleep(0.1)
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 130, err
    assert err.splitlines()[-1:] == ["mixprec: interrupted"] and "Traceback" not in err, err
    assert [line for line in err.splitlines() if line.startswith("mixprec: ")] == [
        "mixprec: interrupted"
    ]


def test_ctrl_c_in_any_command_exits_130_with_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mixprec import cli

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_cmd_policies", interrupted)
    assert main(["policies"]) == 130
    assert capsys.readouterr().err == "mixprec: interrupted\n"


def test_explain_names_a_low_bit_optimizer_state(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "O2-bf16,state=int4(block=64)", "linear"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == (
        "Optimizer state: int4 between steps (4-bit dynamic map, zero-free power-of-two map "
        "for the second moment, one float32 absmax per 64 elements; tensors under 4096 "
        "elements float32), float32 inside step()"
    )
    assert main(["explain", "O2-bf16", "linear"]) == 0
    assert "Optimizer state" not in capsys.readouterr().out
