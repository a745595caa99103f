"""``python -m benchmarks`` checks where it will write before it runs anything: the page's own
command (``--json bench-results/full.json``) on a fresh clone ran ten minutes and then failed
to write into the missing folder, losing every figure."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:  # the benchmarks package lives at the repository root
    sys.path.insert(0, ROOT)

from benchmarks.__main__ import main  # noqa: E402


def test_a_missing_output_folder_is_made(tmp_path: Path) -> None:
    loaded = tmp_path / "run.json"
    loaded.write_text(json.dumps({"cases": {}}))
    out = tmp_path / "bench-results" / "nested" / "full.json"
    assert main(["--load", str(loaded), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["cases"] == {}


@pytest.mark.parametrize("where", ["a file as its folder", "a folder as the file"])
def test_an_output_that_cannot_be_written_stops_the_run_before_any_case(
    tmp_path: Path, where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "run.json" if where == "a file as its folder" else tmp_path
    with pytest.raises(SystemExit, match="cannot"):
        main(["--only", "accuracy", "--json", str(out)])
    assert "[accuracy]" not in capsys.readouterr().err  # no case started
