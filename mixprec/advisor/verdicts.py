"""The advisor's judgement: which runs qualify, what to recommend, why each other run lost.

Pure functions over the :class:`~mixprec.advisor.report.PolicyRun` rows of a report (no framework,
no policy parsing); :func:`mixprec.advisor.run.run_advice` calls them once every run is done.

A run **qualifies** when it trained to the end, at least one of its steps was timed, its
loss distance from float32 is at most ``tolerance``, and it skipped at most
``max_skip_fraction`` of its steps. The dynamic loss scale's warm-up backoffs are not
among those skips: the advisor calibrates the scale before the run
(:attr:`~mixprec.advisor.report.PolicyRun.warmup_skips`), so a float16 policy is judged on its
numerics, not on its scaler's first steps.

The **recommendation** answers the advisor's question, which low-precision policy this model
can train in: the fastest qualifying low-precision run, and float32 (``O0``, the reference)
only when none qualifies. How fast each runs *on this machine* is ranked apart from it:
:func:`fastest` ("fastest here", float32 included: on a CPU without fast float16 it is
often float32) and :func:`safest` ("safest numerics", the qualifying low-precision run
closest to float32's loss). :func:`verdicts` gives every run one line: ``recommended``, the
float32 reference, or why it was rejected.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from mixprec.advisor.report import PolicyRun

__all__ = [
    "REFERENCE",
    "fastest",
    "loss_distance",
    "qualifies",
    "recommend",
    "rejection",
    "safest",
    "timing_notes",
    "verdicts",
]

#: The float32 policy every other run is measured against.
REFERENCE = "O0"


def loss_distance(losses: Sequence[float], reference: Sequence[float]) -> float:
    """Mean of ``|loss - ref| / |ref|`` over the steps both have; ``inf`` if a loss is not
    finite where the reference is."""
    pairs = list(zip(losses, reference, strict=False))
    if not pairs:
        return math.inf
    total = 0.0
    for loss, ref in pairs:
        if not math.isfinite(loss):
            return math.inf
        total += abs(loss - ref) / max(abs(ref), 1e-12)
    return total / len(pairs)


def rejection(run: PolicyRun, tolerance: float, max_skip_fraction: float, steps: int) -> str | None:
    """Why ``run`` does not qualify, in a few words; None when it does."""
    if not run.ok:
        return run.status.replace("failed: ", "it failed: ", 1)
    if run.median_time is None:
        return "no step was timed"
    distance = run.loss_distance
    if distance is None:
        return "no loss distance was measured"
    if not math.isfinite(distance):
        return f"its loss went inf/NaN (loss distance inf > tolerance {tolerance:g})"
    if distance > tolerance:
        return f"loss distance {distance:.3f} > tolerance {tolerance:g}"
    if run.skipped_steps > max_skip_fraction * steps:
        return (
            f"skipped {run.skipped_steps} of {steps} steps after the warm-up "
            f"(> {max_skip_fraction:.0%})"
        )
    return None


def qualifies(run: PolicyRun, tolerance: float, max_skip_fraction: float, steps: int) -> bool:
    """True when ``run`` may be recommended (see the module docstring)."""
    return rejection(run, tolerance, max_skip_fraction, steps) is None


def _time(run: PolicyRun) -> float:
    return run.median_time or math.inf


def _qualified(
    runs: Sequence[PolicyRun], tolerance: float, max_skip_fraction: float, steps: int
) -> list[PolicyRun]:
    return [r for r in runs if qualifies(r, tolerance, max_skip_fraction, steps)]


def recommend(
    runs: Sequence[PolicyRun], tolerance: float, max_skip_fraction: float, steps: int
) -> tuple[str, str]:
    """The fastest qualifying low-precision run's policy and the reason; float32 (``O0``)
    when no low-precision run qualifies."""
    lowp = [
        r for r in _qualified(runs, tolerance, max_skip_fraction, steps) if r.policy != REFERENCE
    ]
    if not lowp:
        return REFERENCE, (
            "no low-precision policy trained within tolerance; float32 is the safe choice"
        )
    best = min(lowp, key=_time)
    base = next((r for r in runs if r.policy == REFERENCE and r.median_time), None)
    speed = ""
    if base is not None and best.median_time:
        speed = f", {_time(base) / best.median_time:.2f}x float32's speed here"
    which = (
        f"fastest of {len(lowp)} low-precision policies"
        if len(lowp) > 1
        else "the only low-precision policy"
    )
    return best.policy, (
        f"{which} whose loss stays within {tolerance:g} of float32's with at most "
        f"{max_skip_fraction:.0%} skipped steps{speed}"
    )


def fastest(
    runs: Sequence[PolicyRun], tolerance: float, max_skip_fraction: float, steps: int
) -> str | None:
    """ "Fastest here": the qualifying run with the smallest median step time, float32
    included; None when nothing qualifies."""
    qualified = _qualified(runs, tolerance, max_skip_fraction, steps)
    return min(qualified, key=_time).policy if qualified else None


def safest(
    runs: Sequence[PolicyRun], tolerance: float, max_skip_fraction: float, steps: int
) -> str | None:
    """ "Safest numerics": the qualifying low-precision run whose loss stays closest to
    float32's (the faster one on a tie); None when no low-precision run qualifies."""
    lowp = [
        r for r in _qualified(runs, tolerance, max_skip_fraction, steps) if r.policy != REFERENCE
    ]
    if not lowp:
        return None
    return min(lowp, key=lambda r: (r.loss_distance or 0.0, _time(r))).policy


def verdicts(
    runs: Sequence[PolicyRun],
    recommended: str,
    tolerance: float,
    max_skip_fraction: float,
    steps: int,
) -> list[str]:
    """One line per run, in order: ``"recommended"``, the float32 reference, or
    ``"rejected: <why>"``."""
    chosen = next((r for r in runs if r.policy == recommended), None)
    quickest = fastest(runs, tolerance, max_skip_fraction, steps)
    lines = []
    for run in runs:
        why = rejection(run, tolerance, max_skip_fraction, steps)
        if run.policy == recommended:
            line = "recommended"
        elif run.policy == REFERENCE:
            line = "float32 reference" + (f", and {why}" if why else "")
        elif why is not None:
            line = f"rejected: {why}"
        elif chosen is not None and chosen.median_time:
            line = f"rejected: {_time(run) / chosen.median_time:.2f}x slower than {recommended}"
        else:
            line = "rejected: slower than the recommended policy"
        if run.policy == quickest and run.policy != recommended:
            line += "; fastest here"
        lines.append(line)
    return lines


def timing_notes(runs: Sequence[PolicyRun], spread: float = 3.0) -> list[str]:
    """A warning for each run whose slowest timed step took over ``spread`` times its
    fastest: the machine was busy, and close candidates may have swapped places."""
    notes = []
    for run in runs:
        if len(run.step_times) > 1 and max(run.step_times) > spread * min(run.step_times):
            notes.append(
                f"{run.policy}: step times vary {max(run.step_times) / min(run.step_times):.0f}x "
                "(a busy machine?); rerun with nothing else running before trusting the ranking"
            )
    return notes
