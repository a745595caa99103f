"""docs/errors.md, the misuse catalogue, cannot drift: every test it names exists, every error
class it names is in mixprec.errors, every quoted message is readable text that the named
test checks, and it keeps at least 60 cases."""

from __future__ import annotations

import ast
import re
from pathlib import Path

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
