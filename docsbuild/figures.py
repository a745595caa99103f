"""Pictures the site draws from the code or from its own pages, at every build.

- ``loss_scale_picture``: mixprec's own :class:`mixprec.DynamicScale` driven through a run
  whose gradients sometimes overflow float16 (the guide's picture of dynamic loss scaling);
- ``benchmark_headline``: the ratios of the Targets table of ``docs/benchmarks.md``, read
  from the page itself, so the chart always shows the figures printed below it.

matplotlib's object API only (no pyplot state, no display).
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "HeadlineRow",
    "benchmark_headline",
    "headline_rows",
    "loss_scale_picture",
    "loss_scale_trace",
]

FLOAT16_MAX = 65504.0


def _figure(width: float, height: float):  # type: ignore[no-untyped-def]
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))


def loss_scale_trace(
    steps: int = 600, interval: int = 100, seed: int = 0
) -> tuple[list[float], list[int]]:
    """The scale before each step and the steps skipped, under ``DynamicScale``.

    The largest gradient of each step (before scaling) drifts around 0.5 with heavy-tailed
    noise; a step overflows when ``scale * gradient`` exceeds float16's largest value, as
    the backward pass in float16 would. ``interval`` is shortened from the default 2000 so
    that a few growth/backoff cycles fit in the picture.
    """
    from mixprec.kit import DynamicScale

    rng = random.Random(seed)
    state = DynamicScale(init=2.0**16, interval=interval)
    scales, skipped = [], []
    for step in range(steps):
        gradient = 0.5 * math.exp(rng.gauss(0.0, 0.6)) * (1.0 + 0.5 * math.sin(step / 90))
        scales.append(state.scale)
        found_inf = state.scale * gradient > FLOAT16_MAX
        if found_inf:
            skipped.append(step)
        state = state.update(found_inf).state  # type: ignore[assignment]
    return scales, skipped


def loss_scale_picture(path: Path) -> Path:
    """Draw :func:`loss_scale_trace` into ``path`` (PNG)."""
    scales, skipped = loss_scale_trace()
    fig = _figure(9.0, 3.2)
    ax = fig.add_subplot()
    ax.plot(range(len(scales)), scales, drawstyle="steps-post", label="loss scale")
    label = f"overflow: step skipped, scale halved ({len(skipped)} of {len(scales)})"
    ax.scatter(skipped, [scales[s] for s in skipped], color="tab:red", marker="x", zorder=3,
               label=label)  # fmt: skip
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("scale")
    ax.set_title("DynamicScale(interval=100): doubles after 100 finite steps, halves on overflow")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


@dataclass(frozen=True)
class HeadlineRow:
    """One ratio target of the benchmarks page: its label, the measured ratio, the limit."""

    label: str
    ratio: float
    limit: float
    met: bool


ROW = re.compile(
    r"^\| (?P<target>[^|]+) \| (?P<limit>[^|]+) \| (?P<figure>[^|]+) \| (?P<verdict>[^|]+) \|$"
)
RATIO = re.compile(r"^\s*(?P<value>\d+(?:\.\d+)?)×")
LIMIT = re.compile(r"≤\s*(?P<value>\d+(?:\.\d+)?)×")


def headline_rows(markdown: str) -> list[HeadlineRow]:
    """The ratio rows of the ``## Targets`` table of the benchmarks page."""
    section = markdown.split("\n## Targets\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        match = ROW.match(line.strip())
        if match is None:
            continue
        ratio, limit = RATIO.match(match["figure"]), LIMIT.search(match["limit"])
        if ratio is None or limit is None:
            continue  # absolute figures (ms, accuracy points) are read in the table
        rows.append(
            HeadlineRow(
                label=match["target"].strip().replace("`", ""),
                ratio=float(ratio["value"]),
                limit=float(limit["value"]),
                met="met" in match["verdict"] and "missed" not in match["verdict"],
            )
        )
    return rows


def benchmark_headline(markdown: str, path: Path) -> Path:
    """A bar per ratio target: the measured ratio, the limit as a tick (lower is better)."""
    rows = headline_rows(markdown)[::-1]
    fig = _figure(11.0, 0.9 + 0.42 * max(1, len(rows)))
    ax = fig.add_subplot()
    ys = range(len(rows))
    colors = ["tab:green" if r.met else "tab:orange" for r in rows]
    ax.barh(list(ys), [r.ratio for r in rows], color=colors, height=0.6)
    ax.scatter([r.limit for r in rows], list(ys), marker="|", s=400, color="black", zorder=3,
               label="the target's limit")  # fmt: skip
    for y, row in zip(ys, rows, strict=True):
        ax.annotate(f"{row.ratio:.2f}×", (row.ratio, y), xytext=(4, -3),
                    textcoords="offset points", fontsize=8)  # fmt: skip
    ax.set_yticks(list(ys), [r.label for r in rows], fontsize=8)
    ax.axvline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("measured ratio (lower is better; green: target met, orange: missed)")
    ax.set_title("Headline ratios of the run below")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path
