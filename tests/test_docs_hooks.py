"""docs/plugins.md cannot drift: its hook reference matches mixprec/engine/hookspecs.py, and its
code examples are the files the tests run.

Hook reference: every hook is a ``### `name` `` heading under ``## Hook reference``, followed
by a ```` ```python ```` block holding its ``def`` line and a ``firstresult: yes|no`` line.

Included code: a block preceded by ``<!-- include: PATH -->`` (a whole file) or
``<!-- include: PATH::Name.attr -->`` (one class or function) must equal that source.
``python tests/test_docs_hooks.py --update`` rewrites the included blocks from the sources.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

import mixprec.engine.hookspecs as hookspecs

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "plugins.md"
HOOK_HEADING = re.compile(r"^### `(\w+)`\s*$", re.MULTILINE)
INCLUDE = re.compile(
    r"<!-- include: (?P<target>\S+) -->\n```(?P<lang>\w*)\n(?P<body>.*?)```", re.DOTALL
)


def _hook_reference() -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index("\n## Hook reference")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _documented() -> dict[str, str]:
    """Hook name -> the markdown section describing it."""
    ref = _hook_reference()
    heads = list(HOOK_HEADING.finditer(ref))
    ends = [h.start() for h in heads[1:]] + [len(ref)]
    return {h.group(1): ref[h.end() : end] for h, end in zip(heads, ends, strict=True)}


def _real_hooks() -> dict[str, ast.FunctionDef]:
    tree = ast.parse(Path(hookspecs.__file__).read_text(encoding="utf-8"))
    return {
        node.name: node
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and hasattr(getattr(hookspecs, node.name), "mixprec_spec")
    }


def _signature(node: ast.FunctionDef) -> tuple[list[tuple[str, str | None]], str | None]:
    args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
    params = [(a.arg, ast.unparse(a.annotation) if a.annotation else None) for a in args]
    return params, ast.unparse(node.returns) if node.returns else None


def _documented_def(name: str, section: str) -> ast.FunctionDef:
    block = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert block, f"docs/plugins.md: the {name} section has no ```python block"
    line = next((ln for ln in block.group(1).splitlines() if ln.startswith("def ")), None)
    assert line, f"docs/plugins.md: the {name} block has no def line"
    node = ast.parse(line.rstrip(":") + ": ...").body[0]
    assert isinstance(node, ast.FunctionDef)
    return node


def test_every_hook_is_in_the_reference_and_nothing_else() -> None:
    documented, real = set(_documented()), set(_real_hooks())
    assert real, "no hooks found in mixprec/engine/hookspecs.py"
    assert not real - documented, f"hooks missing from docs/plugins.md: {sorted(real - documented)}"
    assert not documented - real, f"documented hooks that do not exist: {sorted(documented - real)}"


@pytest.mark.parametrize("name", sorted(_real_hooks()))
def test_documented_signature_matches_hookspec(name: str) -> None:
    section = _documented().get(name)
    if section is None:
        pytest.fail(f"{name} is missing from docs/plugins.md")
    assert _signature(_documented_def(name, section)) == _signature(_real_hooks()[name])


@pytest.mark.parametrize("name", sorted(_real_hooks()))
def test_documented_firstresult_matches_hookspec(name: str) -> None:
    section = _documented().get(name)
    if section is None:
        pytest.fail(f"{name} is missing from docs/plugins.md")
    said = re.search(r"firstresult: (yes|no)", section)
    assert said, f"the {name} section must say 'firstresult: yes' or 'firstresult: no'"
    real = getattr(hookspecs, name).mixprec_spec["firstresult"]
    assert (said.group(1) == "yes") == bool(real)


def _included_source(target: str) -> str:
    path, _, qualname = target.partition("::")
    source = (ROOT / path).read_text(encoding="utf-8")
    if not qualname:
        return source
    nodes: list[ast.stmt] = ast.parse(source).body
    node: ast.stmt | None = None
    for part in qualname.split("."):
        node = next(
            (n for n in nodes if isinstance(n, ast.ClassDef | ast.FunctionDef) and n.name == part),
            None,
        )
        assert node is not None, f"{target}: no {part!r} in {path}"
        nodes = node.body  # type: ignore[attr-defined]
    assert node is not None
    lines = source.splitlines(keepends=True)
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    indent = len(lines[first - 1]) - len(lines[first - 1].lstrip())
    return "".join(line[indent:] for line in lines[first - 1 : node.end_lineno])


def test_included_code_is_the_tested_source() -> None:
    text = DOC.read_text(encoding="utf-8")
    includes = list(INCLUDE.finditer(text))
    assert includes, "docs/plugins.md includes no code"
    stale = [m["target"] for m in includes if m["body"] != _included_source(m["target"])]
    assert not stale, f"out of date in docs/plugins.md (run python {__file__} --update): {stale}"


def update() -> None:
    """Rewrite every included block of docs/plugins.md from its source."""
    text = DOC.read_text(encoding="utf-8")

    def fill(m: re.Match[str]) -> str:
        return (
            f"<!-- include: {m['target']} -->\n```{m['lang']}\n{_included_source(m['target'])}```"
        )

    DOC.write_text(INCLUDE.sub(fill, text), encoding="utf-8")


if __name__ == "__main__" and "--update" in sys.argv:
    update()
