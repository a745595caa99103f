"""docs/errors.md, the misuse catalogue, cannot drift: every test it names exists, every error
class it names is in mixprec.errors, every quoted message is readable text that the named
test checks, and it keeps at least 60 cases; each error class has its usual fix and a snippet
whose mistake raises that class and whose fix then runs."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import mixprec.errors

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "errors.md"
ROW = re.compile(r"^\| .+ \| `(\w+)` \| .+ \| `([\w/.-]+\.py)::(\w+)` \|$", re.MULTILINE)
MESSAGE = re.compile(r"^\| .+ \| `\w+` \| `(.+)` \| `([\w/.-]+\.py)::\w+` \|$", re.MULTILINE)


def _rows() -> list[tuple[str, str, str]]:
    return ROW.findall(DOC.read_text(encoding="utf-8"))


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    }


def test_the_catalogue_has_at_least_60_cases() -> None:
    assert len(_rows()) >= 60


def test_every_named_test_exists() -> None:
    missing = []
    for _, path, name in _rows():
        file = ROOT / path
        if not file.is_file() or name not in _test_functions(file):
            missing.append(f"{path}::{name}")
    assert not missing, f"docs/errors.md names tests that do not exist: {missing}"


def test_every_named_error_class_is_a_mixprec_error() -> None:
    for cls, path, name in _rows():
        error = getattr(mixprec.errors, cls, None)
        assert isinstance(error, type) and issubclass(error, mixprec.errors.MixprecError), (
            f"{path}::{name} names {cls}, not a class of mixprec.errors"
        )


def test_the_catalogue_links_the_thread_safety_contract() -> None:
    assert "architecture.md#threads" in DOC.read_text(encoding="utf-8")
    assert "\n### Threads\n" in (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")


def test_messages_are_readable_and_checked_by_their_test() -> None:
    """The message column quotes words, not a test's regular expression, and the named test
    file checks those words (its regexes read with their backslashes dropped)."""
    rows = MESSAGE.findall(DOC.read_text(encoding="utf-8"))
    assert len(rows) >= 60
    unchecked = []
    for message, path in rows:
        assert not re.search(r"\\.|\.\*|\.\+", message), f"a regular expression: {message!r}"
        source = (ROOT / path).read_text(encoding="utf-8").replace("\\", "")
        words = re.findall(r"[\w.=:()\[\]/-]+", message.replace("…", " ").replace(" or ", " "))
        missing = [word for word in words if word not in source]
        if missing:
            unchecked.append(f"{path}: {message!r} ({missing} not in the test file)")
    assert not unchecked, "\n".join(unchecked)


SNIPPETS = "\n## Each class: a short example\n"
#: Classes whose snippet shows how to catch the error and is not run (the page says why).
NOT_RUN = {"DistributedError"}


def _class_table() -> list[str]:
    head = DOC.read_text(encoding="utf-8").split("| class | also a | raised for |", 1)[1]
    return re.findall(r"^\| `(\w+)` \|", head.split("\n\n", 1)[0], re.MULTILINE)


def _snippets() -> dict[str, tuple[str, str]]:
    """Each class heading of the examples section: (the text before its code, the code)."""
    section = DOC.read_text(encoding="utf-8").split(SNIPPETS, 1)[1].split("\n## ", 1)[0]
    found = {}
    for part in re.split(r"^### ", section, flags=re.MULTILINE)[1:]:
        name = re.match(r"`(\w+)`\n", part)
        code = re.search(r"^```python\n(.*?)^```$", part, re.MULTILINE | re.DOTALL)
        assert name and code, f"a heading `Class` and a python block: {part[:60]!r}"
        found[name.group(1)] = (part[: code.start()], code.group(1))
    return found


def _caught_and_fixed(cls: str, code: str) -> ast.Module:
    """The snippet with a record of the error its ``except`` catches: one top-level
    ``try`` whose only handler catches ``mixprec.errors.<cls> as err``, then the fix."""
    tree = ast.parse(code)
    tries = [i for i, node in enumerate(tree.body) if isinstance(node, ast.Try)]
    assert len(tries) == 1, f"{cls}: one top-level try, the mistake"
    assert cls in NOT_RUN or tries[0] < len(tree.body) - 1, f"{cls}: the fix after the try"
    node = tree.body[tries[0]]
    assert not node.orelse and not node.finalbody and len(node.handlers) == 1, cls
    handler = node.handlers[0]
    assert ast.unparse(handler.type) == f"mixprec.errors.{cls}" and handler.name, cls
    record = ast.parse(f"__caught__.append(type({handler.name}))").body
    handler.body[:0] = record
    return ast.fix_missing_locations(tree)


def test_every_class_has_a_fix_and_a_snippet() -> None:
    classes = _class_table()
    assert len(classes) == 11 and set(classes) <= set(dir(mixprec.errors)), classes
    text = DOC.read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(\w+)` \|.*\| ([^|]+) \|$", text.split("\n\n## ", 1)[0], re.M)
    assert [name for name, _ in rows] == classes and all(len(fix) > 20 for _, fix in rows)
    snippets = _snippets()
    assert list(snippets) == classes, "one example per class, in the table's order"
    for cls in NOT_RUN:
        assert "Not run by the tests" in snippets[cls][0], cls
        _caught_and_fixed(cls, snippets[cls][1])  # parses, and catches its class


@pytest.mark.parametrize("cls", [name for name in _class_table() if name not in NOT_RUN])
def test_each_class_snippet_raises_its_class_then_the_fix_runs(
    cls: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mistake inside ``try`` raises exactly the class of the heading (the ``except``
    branch must run), and the fix after it runs without an error."""
    from mixprec.engine import plugins

    code = _snippets()[cls][1]
    if "import torch" in code:
        pytest.importorskip("torch")
    tree = _caught_and_fixed(cls, code)
    caught: list[type] = []
    monkeypatch.chdir(tmp_path)  # the files the snippets write
    plugins.reset()
    try:
        exec(compile(tree, f"docs/errors.md ({cls})", "exec"), {"__caught__": caught})
    finally:
        plugins.reset()
    assert caught == [getattr(mixprec.errors, cls)], f"{cls}: the mistake raised nothing"
