"""The plugin kit is the one door from the backends and plugins into the core.

docs/reference/kit.md lists every name of ``mixprec.kit.__all__`` under the group the kit's
source gives it, with the module that defines it; every backend and plugin source file imports
the core only through ``mixprec.kit``, ``mixprec.errors``, ``mixprec.testing`` and the face
(``mixprec``, ``mixprec.<backend>``), function-level and ``TYPE_CHECKING`` imports included;
and import-linter's ``forbidden`` contract names every other core module and wing, so a new
one cannot slip past it.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import mixprec.kit as kit

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "kit.md"
#: The core modules a backend or plugin may import, besides the face ``mixprec`` itself.
ALLOWED = {"kit", "errors", "testing"}
#: ``mixprec.<backend>``: the face of each backend and plugin, not a core module.
FACADES = {"torch", "mxnet", "numpy", "jax"}
#: Where the backends and plugins live: (source folder, import name).
SOURCES = [
    (ROOT / "backends" / "torch", "mixprec_torch"),
    (ROOT / "backends" / "mxnet", "mixprec_mxnet"),
    (ROOT / "plugins" / "mixprec-numpy" / "src" / "mixprec_numpy", "mixprec_numpy"),
    (ROOT / "plugins" / "mixprec-jax" / "src" / "mixprec_jax", "mixprec_jax"),
]
KIT_CONTRACT = "backends and plugins reach the core only through the kit"
ROW = re.compile(r"^\| `(\w+)` \| `([\w.]+)` \| .+ \|$", re.MULTILINE)


def _core_children() -> set[str]:
    """The modules and wings at the top of ``mixprec/`` (the face itself excluded)."""
    package = ROOT / "mixprec"
    modules = {path.stem for path in package.glob("*.py")} - {"__init__"}
    wings = {path.name for path in package.iterdir() if (path / "__init__.py").is_file()}
    return modules | wings


def _kit_groups() -> dict[str, list[str]]:
    """The kit's ``__all__`` as its source groups it (a ``# group`` comment, then names)."""
    source = (ROOT / "mixprec" / "kit.py").read_text(encoding="utf-8")
    body = source[source.index("__all__ = [") :]
    body = body[: body.index("\n]")]
    groups: dict[str, list[str]] = {}
    current = None
    for line in body.splitlines()[1:]:
        line = line.strip()
        if line.startswith("#"):
            current = line.lstrip("# ").strip().lower()
            groups[current] = []
        elif line:
            assert current is not None, f"a kit name before the first group: {line}"
            groups[current].append(line.strip('",'))
    return groups


def _page_groups() -> dict[str, dict[str, str]]:
    """The page's ``## group`` sections: each name with its *defined in* module."""
    text = PAGE.read_text(encoding="utf-8")
    sections = re.split(r"^## (.+)$", text, flags=re.MULTILINE)[1:]
    return {
        title.strip().lower(): dict(ROW.findall(body))
        for title, body in zip(sections[::2], sections[1::2], strict=True)
    }


def _defines(module_name: str, name: str) -> bool:
    """True when ``module_name``'s source defines ``name`` at its top level."""
    module = importlib.import_module(module_name)
    assert module.__file__ is not None
    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef) and node.name == name:
            return True
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
    return False


def test_the_page_lists_every_kit_name_under_its_group() -> None:
    kit_groups = _kit_groups()
    page = _page_groups()
    assert [name for names in kit_groups.values() for name in names] == list(kit.__all__)
    assert list(page) == list(kit_groups), "the page's sections are the kit's groups, in order"
    for group, names in kit_groups.items():
        assert sorted(page[group]) == sorted(names), f"section {group!r} of {PAGE.name}"


def test_the_page_names_the_module_that_defines_each_name() -> None:
    for rows in _page_groups().values():
        for name, module_name in rows.items():
            assert hasattr(kit, name)
            value = getattr(importlib.import_module(module_name), name)
            assert value is getattr(kit, name), f"{name}: the kit's is not {module_name}'s"
            assert _defines(module_name, name), f"{name} is not defined in {module_name}"


def test_the_page_is_in_the_nav() -> None:
    assert "reference/kit.md" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")


MODULE_PATH = re.compile(r"mixprec(\.\w+)+")


def _core_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """Every core module an AST imports: ``import``/``from`` statements anywhere (in functions
    and under ``TYPE_CHECKING`` too), and the module paths named as strings: a lazy table's
    ``"name": "mixprec.x"`` and ``importlib.import_module("mixprec.x")``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        strings: list[ast.expr | None] = []
        if isinstance(node, ast.Dict):
            strings = node.values
        elif isinstance(node, ast.Call) and "import_module" in ast.unparse(node.func):
            strings = node.args[:1]
        for value in strings:
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                if MODULE_PATH.fullmatch(value.value):
                    found.append((value.lineno, value.value))
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            if node.module == "mixprec":  # from mixprec import <submodule>, not a face name
                submodules = _core_children() | FACADES
                found += [
                    (node.lineno, f"mixprec.{alias.name}")
                    for alias in node.names
                    if alias.name in submodules
                ]
    return [(line, name) for line, name in found if name.split(".")[0] == "mixprec"]


def test_backends_and_plugins_import_the_core_only_through_the_kit() -> None:
    forbidden = _core_children() - ALLOWED
    checked = 0
    bad = []
    for folder, _ in SOURCES:
        assert folder.is_dir(), folder
        for path in sorted(folder.rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            checked += 1
            for line, name in _core_imports(tree):
                parts = name.split(".")
                if len(parts) > 1 and parts[1] in forbidden:
                    bad.append(f"{path.relative_to(ROOT)}:{line}: {name}")
                elif len(parts) > 1 and parts[1] not in ALLOWED | FACADES:
                    bad.append(f"{path.relative_to(ROOT)}:{line}: {name} (no such module)")
    assert checked > 50
    assert not bad, "import these through mixprec.kit:\n" + "\n".join(bad)


def test_the_forbidden_contract_covers_every_core_module_but_the_kit() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    importlinter = config["tool"]["importlinter"]
    (contract,) = [c for c in importlinter["contracts"] if c["name"] == KIT_CONTRACT]
    assert contract["type"] == "forbidden"
    assert not contract.get("ignore_imports"), "no exceptions"
    assert set(contract["source_modules"]) == {name for _, name in SOURCES}
    assert set(importlinter["root_packages"]) == {"mixprec"} | {name for _, name in SOURCES}
    expected = {f"mixprec.{child}" for child in _core_children() - ALLOWED}
    listed = set(contract["forbidden_modules"])
    assert not expected - listed, f"add to the forbidden contract: {sorted(expected - listed)}"
    assert not listed - expected, f"not core modules (or allowed): {sorted(listed - expected)}"
