"""The documentation site cannot drift: every page is in mkdocs.yml's nav and every API
reference target exists. (``.ci/run`` builds the site itself with ``mkdocs build --strict``.)"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Targets that import a framework (the backends, by the names users import them by).
FRAMEWORK_FACES = (
    "mixprec_mxnet",
    "mixprec_torch",
    "mixprec.torch.",
    "mixprec.mxnet.",
    "mixprec.lightning",
    "mixprec.compat.",
    # the JAX plugin lives in .venv-jax (NumPy 2); its tests check this page's targets there
    "mixprec_jax",
)


def _nav_pages() -> set[str]:
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text.split("\nnav:\n", 1)[1].split("\n\n", 1)[0]
    return set(re.findall(r":\s*(\S+\.md)\s*$", nav, re.M))


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists() -> None:
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert _nav_pages() == pages


def test_every_api_reference_target_resolves() -> None:
    targets = []
    for page in (ROOT / "docs" / "reference").glob("*.md"):
        targets += re.findall(r"^::: (\S+)$", page.read_text(), re.M)
    assert targets
    for target in targets:
        if target.startswith(FRAMEWORK_FACES):
            continue  # tests/test_docs_built.py builds the site; importing frameworks is slow
        module, _, name = target.rpartition(".")
        try:
            importlib.import_module(target)
        except ImportError:
            assert hasattr(importlib.import_module(module), name), target
