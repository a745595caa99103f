"""The home page stays true: its two loops are the example files and run, and its support
table says what wrapping each preset on this machine's CPU actually does."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

import mixprec
from mixprec.errors import UnsupportedDtypeError
from mixprec.policy.presets import BUILTIN_PRESETS

ROOT = Path(__file__).resolve().parents[1]
HOME = ROOT / "docs" / "index.md"
INCLUDE = re.compile(r"<!-- include: (\S+) -->\n```python\n(.*?)```\n<!-- end include -->", re.S)
LOOPS = ["examples/quickstart_torch.py", "examples/quickstart_gluon.py"]


def test_the_loops_are_the_example_files_and_short() -> None:
    found = INCLUDE.findall(HOME.read_text(encoding="utf-8"))
    assert [path for path, _ in found] == LOOPS
    for path, text in found:
        assert text == (ROOT / path).read_text(encoding="utf-8"), f"index.md is stale: {path}"
        code = [line for line in text.splitlines() if line.strip() and "import" not in line]
        assert len(code) <= 16, f"{path}: a first loop should stay short ({len(code)} lines)"


@pytest.mark.parametrize("path", LOOPS)
def test_the_loops_run(path: str, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch" if "torch" in path else "mxnet")
    runpy.run_path(str(ROOT / path), run_name="__main__")
    assert "skipped steps 0" in capsys.readouterr().out


def _support_table() -> dict[str, dict[str, str]]:
    text = HOME.read_text(encoding="utf-8")
    table = text.split("<!-- support-table -->\n", 1)[1].split("\n\n", 1)[0].splitlines()
    head = [cell.strip() for cell in table[0].strip("|").split("|")]
    rows = {}
    for line in table[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = dict(zip(head, cells, strict=True))
    return rows


def test_the_support_table_has_one_row_per_preset() -> None:
    rows = _support_table()
    assert set(rows) == {*BUILTIN_PRESETS, "torch-autocast"}
    for row in rows.values():
        assert row["what it is for"], row


def _runs(cell: str) -> bool:
    assert re.fullmatch(r"yes[¹²³⁴]?|slow|refused|—", cell), cell
    return cell != "refused"


# 'auto' on a CPU without fast bfloat16 says it picks float32: not what these tests check
@pytest.mark.filterwarnings("ignore::mixprec.errors.MixprecWarning")
def test_the_pytorch_cpu_column_is_what_wrap_does() -> None:
    torch = pytest.importorskip("torch")
    import mixprec.torch as mp

    for preset, row in _support_table().items():
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            _, wrapped = mp.wrap(model, optimizer, policy=preset)
            ran, compute = True, mp.state(wrapped).policy.compute
        except UnsupportedDtypeError:
            ran, compute = False, None
        cell = row["PyTorch CPU"]
        assert _runs(cell) == ran, (preset, cell)
        if cell == "slow":  # float16 on a CPU: it runs, through generic kernels
            assert compute == "float16", (preset, compute)


@pytest.mark.filterwarnings("ignore::mixprec.errors.MixprecWarning")
def test_the_gluon_cpu_column_is_what_the_trainer_accepts() -> None:
    mx = pytest.importorskip("mxnet")
    import mixprec.mxnet as mpx

    for preset, row in _support_table().items():
        cell = row["Gluon CPU"]
        if cell == "—":
            continue
        try:
            mpx.resolve_policy(preset, [mx.cpu()])
            ran = True
        except UnsupportedDtypeError:
            ran = False
        assert _runs(cell) == ran, (preset, cell)


def test_the_aliases_line_names_real_aliases() -> None:
    text = HOME.read_text(encoding="utf-8")
    line = text.split("Aliases: ", 1)[1].split("`mixprec backends`", 1)[0]
    pairs = re.findall(r"`([\w-]+)` = `([\w-]+)`", line)
    assert len(pairs) == 5
    for alias, preset in pairs:
        assert mixprec.get_policy(alias) == mixprec.get_policy(preset), alias
