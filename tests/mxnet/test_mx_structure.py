"""The Gluon backend's shape: its imports form a DAG of floors (every import counts: module
level, inside functions, under ``TYPE_CHECKING``), within the package they are relative and at
module level, and the module table in docs/architecture.md lists exactly the files there are,
each on its floor.

Read from the source (no MXNet needed). The trainer once imported checkpoint, export and
stepping, which imported it (or checkpoint) back under ``TYPE_CHECKING``; they now read the
Trainer through the data-only ``trainer_state.py``, as the torch backend's ``optimizer_state.py``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from floors import floors_of

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "backends" / "mxnet"
DOC = ROOT / "docs" / "architecture.md"
MAX_FLOORS = 12


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(encoding="utf-8")) for p in PACKAGE.glob("*.py")}


def _siblings(node: ast.ImportFrom) -> list[str]:
    """The sibling modules a relative ``from . import x`` / ``from .x import y`` names."""
    if node.level != 1:
        return []
    if node.module:
        return [node.module.split(".")[0]]
    return [alias.name for alias in node.names]


def _graph() -> dict[str, set[str]]:
    """Each module -> the sibling modules it imports anywhere (any import statement)."""
    modules = _modules()
    return {
        name: {
            dep
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            for dep in _siblings(node)
            if dep in modules and dep != name
        }
        for name, tree in modules.items()
    }


def floors() -> dict[str, int]:
    """Each module's floor: 1 + the highest floor it imports (1 for none).

    :raises AssertionError: naming the circle, when the imports are not a DAG.
    """
    return floors_of(_graph(), "mixprec_mxnet")


def test_the_imports_form_a_dag_of_floors() -> None:
    result = floors()  # raises on a circle, function-level and TYPE_CHECKING imports included
    top = max(result.values())
    by_floor = {f: sorted(n for n, g in result.items() if g == f) for f in range(1, top + 1)}
    assert top <= MAX_FLOORS, f"mixprec_mxnet has {top} floors (at most {MAX_FLOORS}): {by_floor}"


def test_the_trainer_is_above_what_it_assembles() -> None:
    """checkpoint, states, export and stepping read the Trainer through trainer_state."""
    result, graph = floors(), _graph()
    for name in ("checkpoint", "states", "export", "stepping", "masters", "trainer_state"):
        assert "trainer" not in graph[name], f"{name}.py imports trainer.py"
        assert result[name] < result["trainer"]
    calls = [
        ast.unparse(n.func)
        for n in ast.walk(_modules()["trainer_state"])
        if isinstance(n, ast.Call) and ast.unparse(n.func).startswith(("nd.", "mx.nd."))
    ]
    assert calls == [], "trainer_state.py holds data and names only"


def test_no_absolute_self_imports() -> None:
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert not (node.module or "").startswith("mixprec_mxnet"), (
                    f"{name}.py imports {node.module} absolutely; use a relative import"
                )
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("mixprec_mxnet") for a in node.names), name


def test_no_function_level_sibling_imports() -> None:
    for name, tree in _modules().items():
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.ImportFrom):
                    assert not _siblings(node), (
                        f"{name}.{func.name} imports {_siblings(node)} inside a function"
                    )


def _documented() -> dict[str, int]:
    """Module -> floor, from the Gluon section's module table in docs/architecture.md."""
    text = DOC.read_text(encoding="utf-8")
    match = re.search(r"^### The Gluon backend.*?\n((?:\|[^\n]*\n)+)", text, re.M | re.S)
    assert match, "docs/architecture.md has no '### The Gluon backend' section with a table"
    rows = re.findall(r"^\| `([\w]+)\.py` \| (\d+) \|", match.group(1), re.M)
    return {name: int(floor) for name, floor in rows}


def test_the_architecture_page_lists_every_module_with_its_floor() -> None:
    documented, actual = _documented(), floors()
    assert sorted(documented) == sorted(actual), (
        "docs/architecture.md's Gluon module table must list exactly the files of "
        f"backends/mxnet: missing {sorted(set(actual) - set(documented))}, "
        f"stale {sorted(set(documented) - set(actual))}"
    )
    wrong = {name: (documented[name], floor) for name, floor in actual.items()}
    wrong = {name: pair for name, pair in wrong.items() if pair[0] != pair[1]}
    assert not wrong, f"docs/architecture.md floors (documented, actual): {wrong}"
