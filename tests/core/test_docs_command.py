"""``mixprec docs``: the documentation where a pip user is, without a clone or a network.

The pages ship in the wheel as ``mixprec/_docs/*.md`` (``pyproject.toml`` maps the package
``mixprec._docs`` to ``docs/``); a checkout reads its ``docs/`` folder directly.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import mixprec

ROOT = Path(__file__).resolve().parents[2]


def _mixprec(
    *args: str, cwd: Path, pythonpath: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-m", "mixprec", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip


def test_help_says_where_the_docs_are(tmp_path: Path) -> None:
    out = _mixprec("--help", cwd=tmp_path).stdout
    assert "'mixprec docs' lists its pages" in out and "https://mixprec.readthedocs.io" in out
    assert "docs/ (make docs)" not in out


def test_docs_lists_and_prints_the_pages(tmp_path: Path) -> None:
    listed = _mixprec("docs", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    for page in ("advisor", "errors", "troubleshooting", "migration", "guide"):
        assert f"\n  {page} " in listed.stdout, page
    shown = _mixprec("docs", "troubleshooting", cwd=tmp_path)
    assert shown.stdout == (ROOT / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    wrong = _mixprec("docs", "advisr", cwd=tmp_path)
    assert wrong.returncode == 2
    assert wrong.stderr.startswith("mixprec: error: no documentation page 'advisr'; did you")


def test_an_installed_package_reads_its_shipped_pages(tmp_path: Path) -> None:
    """The layout a wheel installs (mixprec/ with _docs/*.md beside it), away from any
    checkout: ``mixprec docs`` reads the shipped copies."""
    config = (ROOT / "pyproject.toml").read_text(encoding="utf-8")  # (no tomllib on 3.10)
    assert '"mixprec", "mixprec._docs",' in config
    assert '\n"mixprec._docs" = "docs"\n' in config
    assert '\n"mixprec._docs" = ["*.md"]\n' in config
    site = tmp_path / "site"
    shutil.copytree(Path(mixprec.__file__).parent, site / "mixprec",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    (site / "mixprec" / "_docs").mkdir()
    for page in (ROOT / "docs").glob("*.md"):  # what build_py copies for package-data *.md
        shutil.copy(page, site / "mixprec" / "_docs" / page.name)
    run = tmp_path / "elsewhere"
    run.mkdir()
    listed = _mixprec("docs", cwd=run, pythonpath=str(site))
    assert listed.returncode == 0, listed.stderr
    assert f"({site / 'mixprec' / '_docs'})" in listed.stdout
    path = _mixprec("docs", "errors", "--path", cwd=run, pythonpath=str(site)).stdout.strip()
    assert path == str(site / "mixprec" / "_docs" / "errors.md")
