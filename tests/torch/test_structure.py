"""The PyTorch backend's shape: its imports form a DAG of at most 8 floors, within the package
they are relative, private torch names appear only in ``torch_private.py``, and the module
table in docs/architecture.md lists exactly the files there are.

Reads the sources with :mod:`ast` (every import: module level, inside functions and under
``TYPE_CHECKING``), so it needs no torch and fails on the import that brought a circle back.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from floors import floors_of

ROOT = Path(__file__).resolve().parents[2]
BACKEND = ROOT / "backends" / "torch"
PACKAGE = "mixprec_torch"
MAX_FLOORS = 8

# Attribute names private to torch that the backend may use only through torch_private.py.
PRIVATE_ATTRS = {
    "_version",
    "_buffers",
    "_parameters",
    "_modules",
    "_values",
    "_indices",
    "_orig_mod",
    "_opt_called",
    "_wrapped_by_lr_sched",
    "hooked",
}


def _name(path: Path) -> str:
    """A backend file's name relative to the package, as the docs table writes it
    (``"o1/autocast"``, ``"__init__"``, ``"o1/__init__"``)."""
    return path.relative_to(BACKEND).with_suffix("").as_posix()


def _modules() -> dict[str, ast.Module]:
    """Every module of the backend, wings included, by :func:`_name`."""
    return {
        _name(p): ast.parse(p.read_text(encoding="utf-8")) for p in sorted(BACKEND.rglob("*.py"))
    }


def _package_of(name: str) -> list[str]:
    """The package a module's relative imports start from (its own for an ``__init__``)."""
    return name.split("/")[:-1]


def _resolve(parts: list[str], known: set[str]) -> str | None:
    """The backend module ``parts`` names: a module, or a wing by its ``__init__``."""
    for target in ("/".join(parts), "/".join([*parts, "__init__"])):
        if target in known:
            return target
    return None


def _imports(name: str, tree: ast.Module, known: set[str]) -> dict[str, int]:
    """Backend modules this module imports -> the line of the first such import."""
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        targets: list[str | None] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                package = _package_of(name)
                base = package[: len(package) - node.level + 1]
                module = node.module or ""
            elif node.module and (node.module == PACKAGE or node.module.startswith(PACKAGE + ".")):
                base, module = [], node.module.removeprefix(PACKAGE).lstrip(".")
            else:
                continue
            parts = base + (module.split(".") if module else [])
            for alias in node.names:
                # ``from .o1 import autocast`` imports the module; ``from .dtypes import x`` a name
                targets.append(_resolve([*parts, alias.name], known) or _resolve(parts, known))
        elif isinstance(node, ast.Import):
            targets = [
                _resolve(a.name.split(".")[1:], known)
                for a in node.names
                if a.name.startswith(PACKAGE + ".")
            ]
        for target in targets:
            if target is not None:
                found.setdefault(target, node.lineno)
    return found


def floors() -> dict[str, int]:
    """Each backend module's floor: 1 + the highest floor it imports (1 for none).

    :raises AssertionError: naming the circle, when the imports are not a DAG.
    """
    modules = _modules()
    graph = {
        name: set(_imports(name, tree, set(modules) - {name})) for name, tree in modules.items()
    }
    return floors_of(graph, PACKAGE)


def test_the_backend_imports_form_a_dag_of_at_most_eight_floors() -> None:
    result = floors()
    top = max(result.values())
    by_floor = {f: sorted(n for n, g in result.items() if g == f) for f in range(1, top + 1)}
    assert top <= MAX_FLOORS, f"{PACKAGE} has {top} floors (at most {MAX_FLOORS}): {by_floor}"


def test_imports_within_the_backend_are_relative() -> None:
    absolute = []
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module == PACKAGE or node.module.startswith(PACKAGE + "."):
                    absolute.append(f"{name}.py:{node.lineno} from {node.module} import ...")
            elif isinstance(node, ast.Import):
                absolute += [
                    f"{name}.py:{node.lineno} import {a.name}"
                    for a in node.names
                    if a.name.startswith(PACKAGE)
                ]
    # __init__'s TYPE_CHECKING block names the lazy exports by their full path, as the lazy
    # table does; everywhere else a backend module imports its siblings relatively.
    absolute = [a for a in absolute if not a.startswith("__init__.py")]
    assert not absolute, "use relative imports inside the backend: " + "; ".join(absolute)


def test_private_torch_names_appear_only_in_torch_private() -> None:
    offences = []
    for name, tree in _modules().items():
        if name == "torch_private":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                chain = ast.unparse(node)
                if node.attr in PRIVATE_ATTRS or re.match(r"torch(\.\w+)*\._(?!_)", chain):
                    offences.append(f"{name}.py:{node.lineno} {chain}")
            elif isinstance(node, ast.Constant) and node.value in PRIVATE_ATTRS:
                offences.append(f"{name}.py:{node.lineno} {node.value!r}")
    assert not offences, "move these behind mixprec_torch.torch_private: " + "; ".join(offences)


def _documented_modules() -> list[str]:
    """The module column of the PyTorch section's module table in docs/architecture.md."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    match = re.search(r"^### The PyTorch backend.*?\n((?:\|.*\n)+)", text, re.M | re.S)
    assert match, "docs/architecture.md has no '### The PyTorch backend' section with a table"
    rows = [line for line in match.group(1).splitlines() if line.startswith("| `")]
    return [re.match(r"\| `([\w./]+)\.py`", row).group(1) for row in rows]  # type: ignore[union-attr]


def _tabled() -> list[str]:
    """The modules the docs table lists: all but the wings' docstring-only ``__init__``."""
    return [name for name in _modules() if not name.endswith("/__init__")]


def test_the_architecture_page_lists_every_module_with_its_floor() -> None:
    documented = _documented_modules()
    assert sorted(documented) == sorted(_tabled()), (
        "docs/architecture.md's PyTorch module table must list exactly the files of "
        f"backends/torch: missing {sorted(set(_tabled()) - set(documented))}, "
        f"stale {sorted(set(documented) - set(_tabled()))}"
    )
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    for name, floor in floors().items():
        if name.endswith("/__init__"):
            continue
        assert re.search(rf"\| `{name}\.py` \| {floor} \|", text), (
            f"docs/architecture.md: {name}.py is on floor {floor}; update its row"
        )


def test_optimizer_state_holds_data_and_the_step_lives_in_its_protocol() -> None:
    modules = _modules()
    assert "step/protocol" in modules, "the step protocol lives in step/protocol.py"
    calls = [
        ast.unparse(n.func)
        for n in ast.walk(modules["step/optimizer_state"])
        if isinstance(n, ast.Call) and ast.unparse(n.func).startswith("torch.")
    ]
    assert not calls, f"optimizer_state.py should hold data only, but calls {calls}"
