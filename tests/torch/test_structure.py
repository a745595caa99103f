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


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(encoding="utf-8")) for p in sorted(BACKEND.glob("*.py"))}


def _imports(tree: ast.Module, known: set[str]) -> dict[str, int]:
    """Backend modules this module imports -> the line of the first such import."""
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                targets = [node.module.split(".")[0]] if node.module else []
                if not node.module:
                    targets = [a.name for a in node.names]
            elif node.module and (node.module == PACKAGE or node.module.startswith(PACKAGE + ".")):
                parts = node.module.split(".")
                targets = parts[1:2] or [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name.split(".")[1] for a in node.names if a.name.startswith(PACKAGE + ".")]
        for target in targets:
            if target in known:
                found.setdefault(target, node.lineno)
    return found


def floors() -> dict[str, int]:
    """Each backend module's floor: 1 + the highest floor it imports (1 for none).

    :raises AssertionError: naming the circle, when the imports are not a DAG.
    """
    modules = _modules()
    graph = {name: set(_imports(tree, set(modules) - {name})) for name, tree in modules.items()}
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
    return [re.match(r"\| `([\w.]+)\.py`", row).group(1) for row in rows]  # type: ignore[union-attr]


def test_the_architecture_page_lists_every_module_with_its_floor() -> None:
    documented = _documented_modules()
    assert sorted(documented) == sorted(_modules()), (
        "docs/architecture.md's PyTorch module table must list exactly the files of "
        f"backends/torch: missing {sorted(set(_modules()) - set(documented))}, "
        f"stale {sorted(set(documented) - set(_modules()))}"
    )
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    for name, floor in floors().items():
        assert re.search(rf"\| `{name}\.py` \| {floor} \|", text), (
            f"docs/architecture.md: {name}.py is on floor {floor}; update its row"
        )


def test_optimizer_state_holds_data_and_the_step_lives_in_stepping() -> None:
    modules = _modules()
    assert "step" not in modules, "the step protocol lives in stepping.py, not step.py"
    calls = [
        ast.unparse(n.func)
        for n in ast.walk(modules["optimizer_state"])
        if isinstance(n, ast.Call) and ast.unparse(n.func).startswith("torch.")
    ]
    assert not calls, f"optimizer_state.py should hold data only, but calls {calls}"
