"""The PyTorch backend's shape, besides the import-linter contracts that keep its wings in
order (pyproject.toml, ``make lint``): within the package imports are relative, private torch
names appear only in ``torch_private.py``, a wing's ``__init__.py`` is a docstring, no wing or
module shadows a lazy export, and the module table in docs/architecture.md lists exactly the
files there are, each on its wing's floor of the contract.

Reads the sources with :mod:`ast`, so it needs no torch.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
BACKEND = ROOT / "backends" / "torch"
PACKAGE = "mixprec_torch"

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


def _wing_floors() -> dict[str, int]:
    """Each top-level module or wing -> its floor in the wings contract (1 at the bottom)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    (contract,) = [
        c
        for c in config["tool"]["importlinter"]["contracts"]
        if c["type"] == "layers" and c.get("containers") == [PACKAGE]
    ]
    assert not contract.get("ignore_imports"), "the wings admit no exception"
    layers = contract["layers"]  # top floor first
    return {
        name.strip(): len(layers) - index
        for index, layer in enumerate(layers)
        for name in re.split(r"[|:]", layer)
    }


def test_the_architecture_page_lists_every_module_on_its_wings_floor() -> None:
    documented = _documented_modules()
    assert sorted(documented) == sorted(_tabled()), (
        "docs/architecture.md's PyTorch module table must list exactly the files of "
        f"backends/torch: missing {sorted(set(_tabled()) - set(documented))}, "
        f"stale {sorted(set(documented) - set(_tabled()))}"
    )
    floors = _wing_floors()
    floors["__init__"] = max(floors.values()) + 1  # the package itself imports every wing
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    for name in documented:
        floor = floors[name.split("/")[0]]
        assert re.search(rf"\| `{name}\.py` \| {floor} \|", text), (
            f"docs/architecture.md: {name}.py is in a wing on floor {floor}; update its row"
        )


def test_a_wings_init_is_only_a_docstring() -> None:
    """Wings re-export nothing: a name is imported from the module that defines it."""
    for name, tree in _modules().items():
        if name.endswith("/__init__"):
            body = tree.body
            assert len(body) == 1 and ast.get_docstring(tree), f"{name}.py: a docstring only"


def test_no_wing_or_module_shadows_a_lazy_export() -> None:
    """Importing a submodule binds its name on the package: a wing ``wrap/`` would replace
    the lazy ``mixprec_torch.wrap`` for good once anything imported it."""
    tree = _modules()["__init__"]
    (exports,) = [
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
    ]
    names = set(ast.literal_eval(exports))
    children = {name.split("/")[0] for name in _modules()}
    assert not names & children, f"rename these wings or modules: {sorted(names & children)}"


def test_optimizer_state_holds_data_and_the_step_lives_in_its_protocol() -> None:
    modules = _modules()
    assert "step/protocol" in modules, "the step protocol lives in step/protocol.py"
    calls = [
        ast.unparse(n.func)
        for n in ast.walk(modules["step/optimizer_state"])
        if isinstance(n, ast.Call) and ast.unparse(n.func).startswith("torch.")
    ]
    assert not calls, f"optimizer_state.py should hold data only, but calls {calls}"
