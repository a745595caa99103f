"""The Gluon backend's shape, read from the source (no MXNet needed): within the package the
imports are relative and at module level, the wings' ``__init__.py`` hold a docstring only,
the Trainer is one class in one file and sits above what it assembles (the step, the
masters' set-up, the checkpoints), and the module table in docs/architecture.md lists
exactly the files there are, each on its floor (a circle among the imports fails there too:
every import counts, module level, inside functions and under ``TYPE_CHECKING``).

The order of the wings is not checked here: import-linter's contracts for ``mixprec_mxnet`` in
pyproject.toml (``make lint``) keep it, so a new floor is a reviewed diff of the contract, not
a raised number. Modules are named by their path in the package (``step/checkpoint``); the
wings (``o1/``, ``step/``, ``wrapping/``...) are subpackages. The Trainer was once spread
over four files (``Trainer(ScalerCounters, Stepping, gluon.Trainer)``,
``Stepping(MasterSetup)``), the step above the construction it inherited from; the step is
now functions beneath it (``step/protocol.py``) over the data-only ``step/trainer_state.py``,
as the torch backend's ``step/protocol.py`` over ``step/optimizer_state.py``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from floors import floors_of

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "backends" / "mxnet"
DOC = ROOT / "docs" / "architecture.md"


def _key(path: Path) -> str:
    """A module's name in the package, by its path: ``trainer``, ``step/checkpoint``."""
    return path.relative_to(PACKAGE).with_suffix("").as_posix()


def _wing_inits() -> list[Path]:
    return sorted(PACKAGE.glob("*/__init__.py"))


def _modules() -> dict[str, ast.Module]:
    """Every module but the wings' docstring-only ``__init__.py``."""
    inits = set(_wing_inits())
    return {
        _key(p): ast.parse(p.read_text(encoding="utf-8"))
        for p in sorted(PACKAGE.rglob("*.py"))
        if p not in inits
    }


def _siblings(name: str, node: ast.ImportFrom, modules: set[str]) -> list[str]:
    """The package's modules a relative ``from .x import y`` / ``from ..w import x`` in module
    ``name`` names (a wing's ``__init__`` is never one: it holds a docstring only)."""
    if node.level == 0:
        return []
    package = name.split("/")[:-1]
    base = package[: len(package) - (node.level - 1)]
    target = base + (node.module.split(".") if node.module else [])
    if "/".join(target) in modules:
        return ["/".join(target)]
    return [
        "/".join([*target, alias.name])
        for alias in node.names
        if "/".join([*target, alias.name]) in modules
    ]


def _graph() -> dict[str, set[str]]:
    """Each module -> the package's modules it imports anywhere (any import statement)."""
    modules = _modules()
    names = set(modules)
    return {
        name: {
            dep
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            for dep in _siblings(name, node, names)
            if dep != name
        }
        for name, tree in modules.items()
    }


def floors() -> dict[str, int]:
    """Each module's floor: 1 + the highest floor it imports (1 for none).

    :raises AssertionError: naming the circle, when the imports are not a DAG.
    """
    return floors_of(_graph(), "mixprec_mxnet")


def test_the_trainer_is_above_what_it_assembles() -> None:
    """The step, the masters' set-up, the checkpoints and export sit beneath the Trainer and
    read it through the data-only trainer_state."""
    result, graph = floors(), _graph()
    for name in (
        "step/protocol",
        "step/checkpoint",
        "step/states",
        "wrapping/export",
        "wrapping/masters",
        "step/trainer_state",
    ):
        assert "trainer" not in graph[name], f"{name}.py imports trainer.py"
        assert result[name] < result["trainer"]
    calls = [
        ast.unparse(n.func)
        for n in ast.walk(_modules()["step/trainer_state"])
        if isinstance(n, ast.Call) and ast.unparse(n.func).startswith(("nd.", "mx.nd."))
    ]
    assert calls == [], "trainer_state.py holds data and names only"


def test_the_trainer_is_one_class_whose_methods_are_in_its_file() -> None:
    """``Trainer`` is ``gluon.Trainer`` plus the scaler's counters, with no mixin of the
    backend's own, and every ``self.x(...)`` it makes calls a method defined in its class."""
    tree = _modules()["trainer"]
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer"]
    assert [ast.unparse(b) for b in cls.bases] == ["ScalerCounters", "gluon.Trainer"]
    own = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    called = {
        n.func.attr
        for n in ast.walk(cls)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "self"
    }
    assert called <= own, f"Trainer calls {sorted(called - own)} on self, defined elsewhere"


def test_the_wings_init_files_hold_a_docstring_only() -> None:
    assert _wing_inits(), "backends/mxnet has no wings"
    for init in _wing_inits():
        body = ast.parse(init.read_text(encoding="utf-8")).body
        docstring = (
            len(body) == 1
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        )
        assert docstring, f"{_key(init)}.py holds code; a wing's __init__ is its docstring"


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
    modules = _modules()
    for name, tree in modules.items():
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.ImportFrom):
                    found = _siblings(name, node, set(modules))
                    assert not found, f"{name}.{func.name} imports {found} inside a function"


def _documented() -> dict[str, int]:
    """Module -> floor, from the Gluon section's module table in docs/architecture.md."""
    text = DOC.read_text(encoding="utf-8")
    match = re.search(r"^### The Gluon backend.*?\n((?:\|[^\n]*\n)+)", text, re.M | re.S)
    assert match, "docs/architecture.md has no '### The Gluon backend' section with a table"
    rows = re.findall(r"^\| `([\w/]+)\.py` \| (\d+) \|", match.group(1), re.M)
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
