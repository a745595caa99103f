"""The advisor's PNG plots (:meth:`mixprec.advisor.report.AdviceReport.plot`).

matplotlib's object API (``Figure``), never ``pyplot``: no global state, no display needed.
The report is read through the :class:`PlottedReport` protocol, so this module sits below
``advice`` in the core's floors (``advice`` imports it; matplotlib is imported only on call).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from mixprec.atomic import atomic_path
from mixprec.errors import MixprecError

__all__ = ["PlottedReport", "plot_report", "time_vs_distance_figure"]


class PlottedReport(Protocol):
    """What the plots read of an :class:`~mixprec.advisor.report.AdviceReport`."""

    @property
    def backend(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def tolerance(self) -> float: ...
    @property
    def threshold(self) -> float: ...
    @property
    def sensitivity_policy(self) -> str | None: ...
    @property
    def runs(self) -> Sequence[Any]: ...
    @property
    def sensitivity(self) -> Sequence[Any]: ...
    @property
    def tuned_sensitivity(self) -> Sequence[Any]: ...


def _figure(width: float = 7.0, height: float = 4.0) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise MixprecError(
            "AdviceReport.plot() needs matplotlib, which is not installed; "
            "install it with: pip install 'mixprec[advise]'"
        ) from err
    return Figure(figsize=(width, height))


def _save(fig: Any, path: Path, *, tight: bool = False) -> Path:
    """Save ``fig``; ``tight`` crops to what is drawn (a legend outside the axes included)."""
    fig.tight_layout()
    with atomic_path(path, suffix=path.suffix) as tmp:
        fig.savefig(tmp, dpi=100, bbox_inches="tight" if tight else None)
    return path


#: Markers cycled over the runs of the time-vs-distance plot.
MARKERS = "os^Dv<>pP*Xh"


def _wrapped(text: str, width: int = 48) -> str:
    return "\n".join(textwrap.wrap(text, width, subsequent_indent="  ")) or text


def time_vs_distance_figure(report: PlottedReport) -> Any:
    """The figure of ``time_vs_distance.png``: one marker per run, and each run's label (its
    policy and verdict) in a legend beside the axes, never next to the points, so labels of
    runs close together on the plot cannot overlap."""
    fig = _figure(10.0, 4.5)
    ax = fig.add_subplot()
    finite = [
        r.loss_distance
        for r in report.runs
        if r.loss_distance is not None and math.isfinite(r.loss_distance)
    ]
    # a diverged run (inf distance) is drawn at the top edge, marked, instead of vanishing
    ceiling = max([report.tolerance, *finite]) * 1.5 or 1.0
    shown = [r for r in report.runs if r.median_time is not None and r.loss_distance is not None]
    for n, run in enumerate(shown):
        diverged = not math.isfinite(run.loss_distance)
        y = ceiling if diverged else run.loss_distance
        label = f"{run.policy} (diverged)" if diverged else run.policy
        if run.verdict:  # why it was rejected, or that it is the recommended one
            label += f": {run.verdict}"
        ax.scatter(1e3 * run.median_time, y, marker="x" if diverged else MARKERS[n % len(MARKERS)],
                   s=60 if run.verdict == "recommended" else 36, label=_wrapped(label))  # fmt: skip
    ax.axhline(report.tolerance, linestyle="--", color="grey", label="tolerance")
    ax.set_xlabel("median step time (ms)")
    ax.set_ylabel("loss distance from float32")
    ax.set_title(f"{report.backend} on {report.device}: speed vs accuracy")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=7, borderaxespad=0.0)
    return fig


def _time_vs_distance(report: PlottedReport, path: Path) -> Path:
    return _save(time_vs_distance_figure(report), path, tight=True)


def _loss_curves(report: PlottedReport, path: Path) -> Path:
    fig = _figure()
    ax = fig.add_subplot()
    for run in report.runs:
        if run.losses:
            label = f"{run.policy}: {run.verdict}" if run.verdict else run.policy
            ax.plot(range(len(run.losses)), run.losses, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("loss on the same batches")
    ax.legend(fontsize=8)
    return _save(fig, path)


def _loss_scale(report: PlottedReport, path: Path) -> Path:
    fig = _figure()
    ax = fig.add_subplot()
    for run in report.runs:
        if run.loss_scales:
            skipped = f"{run.skipped_steps} skipped"
            if run.warmup_skips:
                skipped += f", +{run.warmup_skips} in the warm-up before it"
            ax.plot(range(len(run.loss_scales)), run.loss_scales, drawstyle="steps-post",
                    label=f"{run.policy} ({skipped})")  # fmt: skip
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    ax.set_title("loss scale over steps (1 = no scaling)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def _sensitivity(report: PlottedReport, path: Path, limit: int = 12) -> Path:
    fig = _figure(7.0, 0.8 + 0.35 * max(1, min(limit, len(report.sensitivity))))
    ax = fig.add_subplot()
    rows = report.sensitivity[:limit][::-1]  # most sensitive at the top
    after = {s.module: s.added_error for s in report.tuned_sensitivity}
    finite = [s.added_error for s in rows if math.isfinite(s.added_error)]
    top = max([report.threshold, *finite]) * 2
    labels = [f"{s.module or '<root>'} ({s.module_class})" for s in rows]
    before_values = [s.added_error if math.isfinite(s.added_error) else top for s in rows]
    ys = list(range(len(rows)))
    ax.barh([y + 0.2 for y in ys], before_values, height=0.4,
            label=report.sensitivity_policy or "low precision")  # fmt: skip
    if after:
        after_values = [after.get(s.module, 0.0) for s in rows]
        after_values = [v if math.isfinite(v) else top for v in after_values]
        ax.barh([y - 0.2 for y in ys], after_values, height=0.4, label="with proposed rules")
    ax.axvline(report.threshold, linestyle="--", color="grey", label="threshold")
    ax.set_yticks(ys, labels, fontsize=8)
    ax.set_xscale("symlog", linthresh=max(report.threshold / 10, 1e-9))
    ax.set_xlabel("added relative error vs float32 (inf drawn at the right edge)")
    ax.set_title("per-module sensitivity")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_report(report: PlottedReport, folder: Path) -> list[Path]:
    """Write the report's four PNG files into ``folder``; return their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    return [
        _time_vs_distance(report, folder / "time_vs_distance.png"),
        _loss_curves(report, folder / "loss_curves.png"),
        _loss_scale(report, folder / "loss_scale.png"),
        _sensitivity(report, folder / "sensitivity.png"),
    ]
