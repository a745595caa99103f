"""Printing results: number formatting, ratios and the per-case tables."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence

from benchmarks.runner import Case, JobResult, Measurement, fmt


def ratio(num: Measurement | None, den: Measurement | None) -> float | None:
    """``num / den`` of the headline figures, or None when either is missing."""
    a = num.value if num is not None else None
    b = den.value if den is not None else None
    if a is None or not b:
        return None
    return a / b


def find(
    measurements: Iterable[Measurement], group: str, contender: str, metric: str | None = None
) -> Measurement | None:
    """The measurement of ``contender`` in ``group`` (the first metric, unless one is named)."""
    for m in measurements:
        if m.group == group and m.contender == contender and (metric is None or m.metric == metric):
            return m
    return None


def table_rows(
    measurements: Sequence[Measurement], baselines: Sequence[str], differences: Sequence[str] = ()
) -> tuple[list[str], dict[str, list[list[str]]]]:
    """Header and rows per group: contender, metric, headline, spread, one ratio per baseline
    (and a Δ column when ``differences`` names reference contenders)."""
    header = ["contender", "metric", "value", "min–max", *(f"× {b}" for b in baselines)]
    if differences:
        header.append(f"Δ vs {differences[0]}")
    extra = len(baselines) + (1 if differences else 0)
    groups: dict[str, list[list[str]]] = {}
    for m in measurements:
        rows = groups.setdefault(m.group, [])
        if not m.ok:
            error = f"error: {m.error or 'no samples'}"
            rows.append([m.contender, m.metric, error, "", *[""] * extra])
            continue
        head = "mean" if m.headline == "mean" else "median"
        value = f"{fmt(m.value)} {m.unit} ({head}, n={len(m.samples)})"
        if m.headline == "mean" and m.stdev is not None:
            value = f"{fmt(m.value)} ± {fmt(m.stdev, 2)} {m.unit} (mean ± sd, n={len(m.samples)})"
        spread = f"{fmt(m.lo)}–{fmt(m.hi)}"
        cells = []
        for b in baselines:
            base = find(measurements, m.group, b, m.metric)
            r = ratio(m, base) if base is not None and b != m.contender else None
            cells.append(f"{r:.2f}×" if r is not None else "")
        if differences:
            refs = (find(measurements, m.group, d, m.metric) for d in differences)
            ref = next((x for x in refs if x is not None), None)
            delta = None
            if ref is not None and ref is not m and ref.value is not None and m.value is not None:
                delta = m.value - ref.value
            cells.append(f"{delta:+.2f}" if delta is not None else "")
        rows.append([m.contender, m.metric, value, spread, *cells])
    return header, groups


def print_case(case: Case, result: JobResult) -> None:
    """The case's figures and ratios as plain-text tables on stdout."""
    print(f"\n== {case.name}: {case.title} ==")
    for line in result.lines:
        print(f"  {line}")
    header, groups = table_rows(result.measurements, case.baselines, case.differences)
    for group, rows in groups.items():
        print(f"\n  {group}" + (f" — {case.groups[group]}" if group in case.groups else ""))
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        widths[2] = min(widths[2], 44)  # long error texts overflow rather than widen the table
        for row in [header, *rows]:
            cells = [cell.ljust(w) for cell, w in zip(row, widths, strict=True)]
            if row[2].startswith("error:"):
                cells = [*cells[:2], _clip(row[2], 160)]
            print("    " + "  ".join(cells).rstrip())
    sys.stdout.flush()


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
