"""The examples in the docstrings of the home page's names run as written (issue 36)."""

from __future__ import annotations

import inspect
import textwrap

import pytest

import mixprec


def _example(obj: object) -> str:
    """The indented block after the docstring's ``Example`` line."""
    doc = inspect.getdoc(obj) or ""
    after = doc.split("Example", 1)[1].split("::\n", 1)[1]
    lines = []
    for line in after.splitlines():
        if line and not line.startswith(" "):
            break
        lines.append(line)
    return textwrap.dedent("\n".join(lines))


@pytest.mark.parametrize("obj", [mixprec.get_policy, mixprec.DynamicScale])
def test_core_docstring_examples_run(obj: object) -> None:
    code = _example(obj)
    assert "mixprec" in code
    exec(compile(code, f"<example of {obj}>", "exec"), {})


def test_the_torch_advise_example_runs() -> None:
    pytest.importorskip("torch")
    import mixprec.torch as mpt

    code = _example(mpt.advise).replace("print(report.table())", "assert report.recommended")
    exec(compile(code, "<example of advise>", "exec"), {})


def test_the_torch_wrap_example_runs() -> None:
    pytest.importorskip("torch")
    import mixprec.torch as mpt

    code = _example(mpt.wrap).replace(
        "print(mpt.state(optimizer).skipped_steps)   # 0",
        "assert mpt.state(optimizer).skipped_steps == 0",
    )
    assert "assert" in code
    exec(compile(code, "<example of wrap>", "exec"), {})


def test_the_gluon_trainer_example_runs() -> None:
    pytest.importorskip("mxnet")
    import mixprec.mxnet as mpx

    code = _example(mpx.Trainer).replace(
        "print(trainer.skipped_steps)   # 0", "assert trainer.skipped_steps == 0"
    )
    assert "assert" in code
    exec(compile(code, "<example of Trainer>", "exec"), {})
