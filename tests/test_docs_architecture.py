"""docs/architecture.md's core table matches the code: every file of mixprec/ is listed once,
no row is stale, and each module sits on the floor the import-linter contract gives it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
ROW = re.compile(r"^\| (\d+) \| `([^`]+)` \|", re.MULTILINE)


def _table() -> list[tuple[int, str]]:
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## Core modules") :]
    section = section[: section.index("\n### ")]
    return [(int(floor), name) for floor, name in ROW.findall(section)]


def _files() -> set[str]:
    package = ROOT / "mixprec"
    files = {path.name for path in package.glob("*.py")}
    folders = {f"{path.name}/" for path in package.iterdir() if (path / "__init__.py").is_file()}
    return files | folders


def _module(name: str) -> str:
    return name.removesuffix(".py").removesuffix("/")


def test_every_core_file_has_exactly_one_row() -> None:
    names = [name for _, name in _table()]
    assert len(names) == len(set(names)), "a module is listed twice"
    listed, present = set(names), _files()
    assert not present - listed, f"missing from docs/architecture.md: {sorted(present - listed)}"
    assert not listed - present, f"stale rows in docs/architecture.md: {sorted(listed - present)}"


def test_floors_match_the_import_linter_contract() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    assert not contract.get("ignore_imports"), "the floors admit no exception (issue 24)"
    layers = contract["layers"]  # top floor first
    from_contract = {
        module.strip(): len(layers) - index
        for index, layer in enumerate(layers)
        for module in layer.split("|")
    }
    from_doc = {_module(name): floor for floor, name in _table() if name != "__init__.py"}
    assert from_doc == from_contract
    # issue 9: nine floors; issue 24: the catalog below policy, the lock below the CLI
    assert max(from_doc.values()) <= 11
