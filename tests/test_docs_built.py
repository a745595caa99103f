"""The built site, read the way a browser gets it: one ``mkdocs build --strict`` per session
into a temporary folder, then the HTML parsed with the standard library.

It checks what a reader meets: every internal link and anchor resolves (the site works
opened as files, so no link ends at a folder), bullet lists are lists, no Sphinx role is
printed literally, every public name is documented under the name users import (with a
signature), code fits the page, and the pictures the build generates are there.
"""

from __future__ import annotations

import ast
import html
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from docsbuild.griffe_mixprec import builtin_backends  # noqa: E402

#: The longest code line the page shows without a horizontal scroll at 1400 px (the wider
#: grid of docs/stylesheets/extra.css); pages wrap theirs at 90, included sources at 100.
CODE_WIDTH = 100
ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|exc|obj):(?=`|$)")
LIST_IN_PARAGRAPH = re.compile(r"\n\s*(?:[-*+]|\d+\.) \S")


@dataclass
class Page:
    """What the tests read of one HTML page."""

    path: Path
    ids: set[str] = field(default_factory=set)
    links: list[tuple[str, str]] = field(default_factory=list)  # (tag, url)
    paragraphs: list[str] = field(default_factory=list)
    code_blocks: list[str] = field(default_factory=list)
    prose: list[str] = field(default_factory=list)  # text outside code
    images: list[str] = field(default_factory=list)
    signatures: dict[str, str] = field(default_factory=dict)  # heading id -> its signature


class _Reader(HTMLParser):
    def __init__(self, page: Page) -> None:
        super().__init__(convert_charrefs=True)
        self.page = page
        self.code = 0  # inside <code> or <pre>
        self.pre: list[str] | None = None
        self.paragraph: list[str] | None = None
        self.heading: str | None = None  # the last doc heading's id
        self.signature: list[str] | None = None
        self.article = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if "id" in a:
            self.page.ids.add(a["id"])
        if tag == "article":
            self.article = True
        for key in ("href", "src"):
            if key in a and tag in ("a", "img", "link", "script"):
                self.page.links.append((tag, a[key]))
        if tag == "img" and self.article:
            self.page.images.append(a.get("src", ""))
        if tag in ("h2", "h3", "h4") and "doc-heading" in a.get("class", ""):
            self.heading = a.get("id")
        if "doc-signature" in a.get("class", "") and self.heading:
            self.signature = []
        if tag in ("code", "pre"):
            self.code += 1
        if tag == "pre":
            self.pre = []
        if tag == "p" and self.article:
            self.paragraph = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("code", "pre"):
            self.code -= 1
        if tag == "pre" and self.pre is not None:
            text = "".join(self.pre)
            if self.signature is not None and self.heading:
                self.page.signatures[self.heading] = text
                self.signature = None
            self.page.code_blocks.append(text)
            self.pre = None
        if tag == "p" and self.paragraph is not None:
            self.page.paragraphs.append("".join(self.paragraph))
            self.paragraph = None
        if tag == "article":
            self.article = False

    def handle_data(self, data: str) -> None:
        if self.pre is not None:
            self.pre.append(data)
        if self.paragraph is not None and not self.code:
            self.paragraph.append(data)
        if not self.code and self.article:
            self.page.prose.append(data)


def read(path: Path) -> Page:
    page = Page(path)
    _Reader(page).feed(path.read_text(encoding="utf-8"))
    return page


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once per session as CI builds it (``--strict``: no warning)."""
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-6000:]
    return out


@pytest.fixture(scope="session")
def pages(site: Path) -> dict[str, Page]:
    return {str(p.relative_to(site)): read(p) for p in site.rglob("*.html")}


def _local(url: str) -> bool:
    return not re.match(r"^(?:[a-z][a-z0-9+.-]*:|//|#)", url) and url != ""


@pytest.mark.slow
def test_every_internal_link_and_anchor_resolves(site: Path, pages: dict[str, Page]) -> None:
    broken = []
    for name, page in pages.items():
        if name == "404.html":  # its links are absolute for the server's error page
            continue
        for tag, url in page.links:
            if not _local(url):
                continue
            target, _, fragment = html.unescape(url).partition("#")
            path = (page.path.parent / target).resolve() if target else page.path
            if not path.is_file():  # a folder would show a listing when opened as a file
                broken.append(f"{name}: <{tag}> {url}")
            elif fragment and path.suffix == ".html":
                if fragment not in pages[str(path.relative_to(site.resolve()))].ids:
                    broken.append(f"{name}: <{tag}> {url} (no such anchor)")
    assert not broken, "\n".join(broken)


def test_the_site_opens_as_files_with_its_search(site: Path, pages: dict[str, Page]) -> None:
    assert "install.html" in pages and (site / "guide.html").is_file()
    links = [url for _, url in pages["index.html"].links if _local(url)]
    assert "install.html" in links and not any(url.endswith("/") for url in links)
    # the offline plugin inlines the search index, which a file:// page cannot fetch
    assert (site / "search" / "search_index.js").is_file()


def test_bullet_lists_render_as_lists(pages: dict[str, Page]) -> None:
    run_on = [
        f"{name}: {text.strip()[:100]!r}"
        for name, page in pages.items()
        for text in page.paragraphs
        if LIST_IN_PARAGRAPH.search(text)
    ]
    assert not run_on, "paragraphs holding a list (a blank line is missing):\n" + "\n".join(run_on)


def test_no_sphinx_role_is_printed_literally(pages: dict[str, Page]) -> None:
    literal = [
        f"{name}: {m.group(0)!r} in {text.strip()[:80]!r}"
        for name, page in pages.items()
        for text in page.prose
        for m in ROLE.finditer(text)
    ]
    assert not literal, "\n".join(literal)
    for page in pages.values():  # nor does a reST literal block leave its '::' behind
        assert not [t for t in page.paragraphs if t.rstrip().endswith("::")], page.path


def _all_of(module: str) -> list[str]:
    """``module.__all__``, read from its source: nothing is imported, no framework loads."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, module
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            names = ast.literal_eval(node.value)  # type: ignore[attr-defined]
            assert isinstance(names, list)
            return names
    raise AssertionError(f"{module} has no __all__")


def _public_names() -> list[str]:
    """Every public name, as users import it."""
    modules = {"mixprec": "mixprec", "mixprec.lightning": "mixprec.lightning"}
    modules |= {"mixprec.compat.apex_amp": "mixprec.compat.apex_amp"}
    modules |= {"mixprec.compat.mxnet_amp": "mixprec.compat.mxnet_amp"}
    modules |= {f"mixprec.{name}": api for name, api in builtin_backends().items()}
    return [f"{shown}.{name}" for shown, source in modules.items() for name in _all_of(source)]


def test_every_public_name_is_documented_under_its_import_name(pages: dict[str, Page]) -> None:
    names = _public_names()
    assert {"mixprec.torch.save", "mixprec.mxnet.clip_global_norm"} <= set(names)
    assert "mixprec.lightning.MixprecPrecision" in names
    documented = set().union(*(p.ids for n, p in pages.items() if n.startswith("reference/")))
    missing = [name for name in names if name not in documented]
    assert not missing, f"public names missing from the API reference: {missing}"
    internal = sorted(i for i in documented if re.match(r"mixprec_(torch|mxnet)\.", i))
    assert not internal, f"headings under internal paths: {internal[:10]}"


def test_functions_and_classes_show_their_signature(pages: dict[str, Page]) -> None:
    signatures: dict[str, str] = {}
    for name, page in pages.items():
        if name.startswith("reference/"):
            signatures |= page.signatures
    trainer = signatures.get("mixprec.mxnet.Trainer", "")
    assert "net_or_params" in trainer and "policy" in trainer, trainer
    assert "models" in signatures.get("mixprec.torch.wrap", "")
    assert "max_norm" in signatures.get("mixprec.mxnet.clip_global_norm", "")
    assert len(signatures) > 150  # every function, class and method has one


def test_code_lines_fit_the_page(pages: dict[str, Page]) -> None:
    long = [
        f"{name}: {len(line)} characters: {line[:60]!r}..."
        for name, page in pages.items()
        for block in page.code_blocks
        for line in block.splitlines()
        if len(line) > CODE_WIDTH
    ]
    assert not long, "\n".join(long)


def test_code_blocks_wrap_where_a_long_line_would_scroll(site: Path) -> None:
    """Below 1400 px (a 1280 px laptop) a 100-character line does not fit beside the two
    sidebars: the site's stylesheet wraps code lines there instead of scrolling."""
    css = (site / "stylesheets" / "extra.css").read_text(encoding="utf-8")
    rule = re.search(r"@media screen and \(max-width: ([\d.]+)em\) \{(.*?)\n\}", css, re.S)
    assert rule is not None, "no narrow-screen rule in extra.css"
    assert 80 <= float(rule.group(1)) < 87.5  # 1280 px is 80em at 16 px
    assert re.search(r"pre > code \{[^}]*white-space: pre-wrap", rule.group(2))
    pages = [p for p in site.rglob("*.html") if "extra.css" in p.read_text(encoding="utf-8")]
    assert len(pages) == len(list(site.rglob("*.html")))  # every page links the stylesheet


def test_long_pages_have_a_table_of_contents(site: Path, pages: dict[str, Page]) -> None:
    """A page longer than three screens (about 150 lines of text at 1280 px) lists its
    sections in the theme's table of contents, beside the page from 1220 px up."""
    long = {name: page for name, page in pages.items() if len("".join(page.prose)) > 12_000}
    assert len(long) >= 8  # the guide, the policies, the errors, the benchmarks...
    for name in long:
        html = (site / name).read_text(encoding="utf-8")
        toc = html.split('aria-label="Table of contents"', 1)
        assert len(toc) == 2, f"{name}: no table of contents"
        entries = re.findall(r'class="md-nav__link"', toc[1].split("</nav>", 1)[0])
        assert len(entries) >= 3, f"{name}: {len(entries)} entries in its table of contents"


def _png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_advisor_page_shows_a_run_of_this_build(site: Path, pages: dict[str, Page]) -> None:
    page = pages["advisor.html"]
    plots = ("time_vs_distance.png", "loss_curves.png", "loss_scale.png", "sensitivity.png")
    for backend in ("torch", "mxnet"):  # both backends' plots are on the page
        shown = [src for src in page.images if f"img/build/advisor/{backend}/" in src]
        assert [src.rsplit("/", 1)[1] for src in shown] == list(plots)
        for src in shown:
            path = site / src
            assert _png(path) and path.stat().st_size > 10_000, src
    text = "\n".join(page.code_blocks)
    for backend in ("torch", "mxnet"):
        assert f"mixprec advise examples.advise_demo:{backend}_digits" in text
        assert f"report: advice/{backend}/report.json" in text
    assert text.count("\nrecommended: ") == 2 and re.search(r"\nO0 +ok ", text)
    assert "\nlow-bit state: O0,state=int8: state " in text  # the int8 twin of float32


def test_the_benchmarks_page_leads_with_its_chart(site: Path, pages: dict[str, Page]) -> None:
    page = pages["benchmarks.html"]
    assert page.images and page.images[0].endswith("img/build/benchmark-headline.png")
    assert _png(site / page.images[0])
    guide = pages["guide.html"].images
    assert any(src.endswith("img/build/loss-scale.png") for src in guide)
    assert any(src.endswith("img/dtype-flow.svg") for src in guide)
