"""docs/benchmarks.md is benchmarks/template.md rendered: the page's prose cannot drift.

The generator (``python -m benchmarks --markdown docs/benchmarks.md``) rewrites the whole page
from the template, so prose edited on the page alone is lost at the next run. Here every
placeholder of the template may stand for any text, and the rest must be the page's, word
for word.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_page_is_the_template_with_its_placeholders_filled() -> None:
    template = (ROOT / "benchmarks" / "template.md").read_text(encoding="utf-8")
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    parts = re.split(r"\{\{[^}]*\}\}", template.rstrip() + "\n")
    pattern = "(.*?)".join(re.escape(part) for part in parts)
    if re.fullmatch(pattern, page, flags=re.S) is None:
        for part in parts:  # name the first stretch of prose the page does not have
            assert part in page, f"docs/benchmarks.md lacks the template's text: {part[:300]!r}"
        raise AssertionError("docs/benchmarks.md has the template's prose in another order")
