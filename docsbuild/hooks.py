"""mkdocs hooks: the pictures and the worked example that the site generates at build time.

A page asks for generated content with a marker on a line of its own,
``<!-- build: NAME -->``, replaced when the site is built (the Markdown files keep only the
marker, so nothing generated is ever committed and nothing can go stale):

- ``advisor-example``: the ``mixprec advise`` commands of the advisor page, run now, with
  what they printed and the machine they ran on (:mod:`docsbuild.advisor_example`);
- ``advisor-plots``: the four plots those runs wrote (PyTorch's);
- ``benchmark-headline``: a chart of the ratios of the benchmarks page's Targets table;
- ``loss-scale``: mixprec's ``DynamicScale`` through a run with overflows.

The images are added to the site as generated files under ``img/build/``.
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # mkdocs loads this file by path
    sys.path.insert(0, str(ROOT))

from docsbuild import advisor_example, figures  # noqa: E402

MARKER = re.compile(r"^<!-- build: (?P<name>[\w-]+) -->$", re.MULTILINE)
CACHE = ROOT / "build" / "docs-cache"
IMG = "img/build"

PLOT_CAPTIONS = {
    "time_vs_distance.png": "Median step time against loss distance from float32; the "
    "tolerance is dashed: the fastest policy under it is recommended.",
    "loss_curves.png": "The training loss of each policy on the same batches.",
    "loss_scale.png": "The loss scale after every step (1: no scaling, as under bfloat16).",
    "sensitivity.png": "Added error per module under the fastest low-precision policy, "
    "before and after the proposed float32 rules; the threshold is dashed.",
}

_state: dict[str, Any] = {}


def _generated(config: Any, uri: str, path: Path) -> Any:
    from mkdocs.structure.files import File

    return File.generated(config, uri, abs_src_path=str(path))


def on_files(files: Any, config: Any) -> Any:
    """Run the generators once per build and add their images to the site's files."""
    images = CACHE / "images"
    images.mkdir(parents=True, exist_ok=True)
    header, examples = advisor_example.run_examples(ROOT, CACHE)
    _state["advisor"] = (header, examples)
    for example in examples:
        for plot in advisor_example.PLOTS:
            path = example.folder / plot
            if not path.is_file():
                raise RuntimeError(f"the advisor example wrote no {path}")
            files.append(_generated(config, f"{IMG}/advisor/{example.backend}/{plot}", path))
    benchmarks = (Path(config["docs_dir"]) / "benchmarks.md").read_text(encoding="utf-8")
    files.append(
        _generated(
            config,
            f"{IMG}/benchmark-headline.png",
            figures.benchmark_headline(benchmarks, images / "benchmark-headline.png"),
        )
    )
    files.append(
        _generated(
            config, f"{IMG}/loss-scale.png", figures.loss_scale_picture(images / "loss-scale.png")
        )
    )
    return files


def _prefix(page: Any) -> str:
    depth = page.file.src_uri.count("/")
    return "../" * depth


def wrap_output(text: str, width: int = 90) -> str:
    """Lines longer than ``width`` folded at spaces, continued with an indent (the site shows
    code without a horizontal scroll)."""
    lines = []
    for line in text.splitlines():
        if len(line) <= width:
            lines.append(line)
            continue
        indent = " " * (len(line) - len(line.lstrip()) + 4)
        lines += textwrap.wrap(
            line, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
        )
    return "\n".join(lines)


def _advisor_example() -> str:
    header, examples = _state["advisor"]
    parts = [f"Generated when this site was built: {header}.", ""]
    for example in examples:
        command = wrap_output(example.command).replace("\n", " \\\n")
        parts += ["```sh", command, "```", "", "```text", wrap_output(example.output), "```", ""]
    return "\n".join(parts)


def _advisor_plots(prefix: str) -> str:
    """Every backend's four plots, a heading each (the runs of ``advisor-example``)."""
    _, examples = _state["advisor"]
    names = {"torch": "PyTorch", "mxnet": "MXNet Gluon"}
    parts = []
    for example in examples:
        rows = []
        for plot in advisor_example.PLOTS:
            caption = PLOT_CAPTIONS[plot]
            uri = f"{prefix}{IMG}/advisor/{example.backend}/{plot}"
            rows.append(f'![{names.get(example.backend, example.backend)}: {caption}]({uri})'
                        '{ width="49%" }')  # fmt: skip
        title = names.get(example.backend, example.backend)
        parts.append(f"**{title}** (`{example.command}`):\n\n" + "\n".join(rows))
    captions = " ".join(
        f"**{n}.** {PLOT_CAPTIONS[plot]}" for n, plot in enumerate(advisor_example.PLOTS, 1)
    )
    return "\n\n".join(parts) + f"\n\nIn each: {captions}\n"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace each ``<!-- build: NAME -->`` marker with what it names."""
    prefix = _prefix(page)

    def replace(match: re.Match[str]) -> str:
        name = match["name"]
        if name == "advisor-example":
            return _advisor_example()
        if name == "advisor-plots":
            return _advisor_plots(prefix)
        if name == "benchmark-headline":
            return (
                f"![The ratios of the Targets table below, each against its limit]"
                f"({prefix}{IMG}/benchmark-headline.png)"
            )
        if name == "loss-scale":
            return (
                f"![The loss scale of DynamicScale over 600 steps: it halves at each "
                f"overflow and doubles after 100 finite steps]({prefix}{IMG}/loss-scale.png)"
            )
        raise ValueError(f"{page.file.src_uri}: unknown build marker {name!r}")

    return MARKER.sub(replace, markdown)
