"""docs/architecture.md's core section matches the code: the top of mixprec/ and each wing has
a table listing every module once, on the floor its import-linter contract gives it; every
package of the core has an exhaustive contract with no exception; and the core is at most
eight floors high, in the contract and in the imports themselves."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))

from floors import floors_of  # noqa: E402

DOC = ROOT / "docs" / "architecture.md"
CORE = ROOT / "mixprec"
#: At most this many floors, top to bottom of the core (issue 32): a new floor is a reviewed
#: change of this number, of the contract and of the doc, never a quiet one.
MAX_FLOORS = 8
LABEL = re.compile(r"^\*\*`(mixprec/[\w/]*)`\*\*", re.MULTILINE)
ROW = re.compile(r"^\| (\d+) \| `([^`]+)` \|", re.MULTILINE)


def _section() -> str:
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## Core modules") :]
    return section[: section.index("\n### ")]


def _doc_tables() -> dict[str, list[tuple[int, str]]]:
    """Each ``**`mixprec/<wing>/`**`` label with the rows of the table after it."""
    section = _section()
    labels = list(LABEL.finditer(section))
    tables = {}
    for label, following in zip(labels, [*labels[1:], None], strict=True):
        body = section[label.end() : following.start() if following else len(section)]
        package = label.group(1).rstrip("/").replace("/", ".")
        assert package not in tables, f"{label.group(1)} has two tables"
        tables[package] = [(int(floor), name) for floor, name in ROW.findall(body)]
    return tables


def _packages() -> list[str]:
    """mixprec and every subpackage of it, as dotted names."""
    return sorted(
        ".".join(init.parent.relative_to(ROOT).parts) for init in CORE.rglob("__init__.py")
    )


def _children(package: str) -> set[str]:
    """The modules (``x.py``) and subpackages (``x/``) directly inside ``package``."""
    folder = ROOT.joinpath(*package.split("."))
    files = {path.name for path in folder.glob("*.py")} - {"__init__.py"}
    folders = {f"{path.name}/" for path in folder.iterdir() if (path / "__init__.py").is_file()}
    return files | folders


def _contracts() -> dict[str, dict[str, object]]:
    """The layers contract of each core package, by its container."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    found: dict[str, dict[str, object]] = {}
    for contract in config["tool"]["importlinter"]["contracts"]:
        assert not contract.get("ignore_imports"), f"{contract['name']}: no exceptions"
        if contract["type"] != "layers":
            continue
        for container in contract.get("containers", []):
            if container == "mixprec" or container.startswith("mixprec."):
                assert container not in found, f"{container} has two layers contracts"
                found[container] = contract
    return found


def _floors(contract: dict[str, object]) -> dict[str, int]:
    layers = contract["layers"]  # top floor first
    assert isinstance(layers, list)
    return {
        module.strip(): len(layers) - index
        for index, layer in enumerate(layers)
        for module in layer.split("|")
    }


def _name(entry: str) -> str:
    return entry.removesuffix(".py").removesuffix("/")


def test_every_core_package_has_one_table_listing_each_module_once() -> None:
    tables = _doc_tables()
    assert sorted(tables) == _packages(), "one table per wing, no table for a missing one"
    for package, rows in tables.items():
        names = [name for _, name in rows]
        assert len(names) == len(set(names)), f"{package}: a module is listed twice"
        listed, present = set(names), _children(package)
        assert not present - listed, f"missing from the {package} table: {present - listed}"
        assert not listed - present, f"stale rows in the {package} table: {listed - present}"


def test_floors_match_the_import_linter_contracts() -> None:
    contracts = _contracts()
    assert sorted(contracts) == _packages(), "every core package has its layers contract"
    for package, rows in _doc_tables().items():
        contract = contracts[package]
        assert contract.get("exhaustive") is True, f"{package}: a new module must get a floor"
        assert {_name(name): floor for floor, name in rows} == _floors(contract), package


def test_the_core_is_at_most_eight_floors_high() -> None:
    top = _floors(_contracts()["mixprec"])
    assert max(top.values()) == len(_contracts()["mixprec"]["layers"]) <= MAX_FLOORS
    assert top["cli"] == max(top.values()), "the command is on top"


def _imports_of(path: Path, package: str) -> set[str]:
    """Every mixprec module ``path`` imports (function-level and TYPE_CHECKING included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.add(module)
            found |= {f"{module}.{alias.name}" for alias in node.names}
    return {name for name in found if name == "mixprec" or name.startswith("mixprec.")}


def test_the_imports_between_the_top_level_modules_and_wings_are_eight_floors() -> None:
    """The same height from the code itself: the DAG of mixprec's top-level modules and
    wings (a wing's imports are those of all its files), the package face included."""
    units = {_name(child) for child in _children("mixprec")} | {"__init__"}
    graph: dict[str, set[str]] = {unit: set() for unit in units}
    for path in CORE.rglob("*.py"):
        parts = path.relative_to(CORE).parts
        unit = _name(parts[0]) if len(parts) == 1 else parts[0]
        package = ".".join(path.parent.relative_to(ROOT).parts)
        for name in _imports_of(path, package):
            target = name.split(".")[1] if "." in name else "__init__"
            if target in units and target != unit:
                graph[unit].add(target)
    floors = floors_of(graph, "mixprec")
    assert max(floors.values()) <= MAX_FLOORS, floors
