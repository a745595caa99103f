"""The advisor's judgement: which runs qualify, what to recommend, why each other run lost.

Pure functions over the :class:`~mixprec.advisor.report.PolicyRun` rows of a report (no framework,
no policy parsing); :func:`mixprec.advisor.run.run_advice` calls them once every run is done.

A run **qualifies** when it trained to the end, at least one of its steps was timed, its
loss distance from float32 is at most ``tolerance``, and it skipped at most
``max_skip_fraction`` of its steps. The dynamic loss scale's warm-up backoffs are not
among those skips: the advisor calibrates the scale before the run
(:attr:`~mixprec.advisor.report.PolicyRun.warmup_skips`), so a float16 policy is judged on its
numerics, not on its scaler's first steps.

The **recommendation** answers the question of its ``objective``:

- ``"speed"`` (the default): which policy on this machine. The fastest qualifying run,
  float32 included, so it is never a policy slower than float32 here;
- ``"memory"``: the qualifying run with the smallest peak memory;
- ``"numerics"``: which low-precision policy this model can train in, wherever it runs
  (portable numerics): the qualifying low-precision run closest to float32's loss; float32
  (``O0``) when none qualifies.

**Ties** keep identical runs giving the same answer: runs whose measure (median step time,
peak memory) is within :data:`TIE` (10%) of the best one are tied, and so is, for speed, a
run whose fastest step is within that band (on a busy machine the ranges overlap), and a tie
goes, in this order, to a run that is not *cautioned* (a preset the docs warn about: low-
precision weights without float32 masters, ``O3``/``O3-bf16``, whose updates can round
away), to the run closest to float32's loss (float32 itself first), then to the earlier
candidate. Loss distances are the same from run to run (same seeds, same batches); times are
not, so they only decide when they differ by more than the noise.

**Low-bit optimizer state.** A run whose policy keeps the optimizer's state in 8 or 4 bits
(``state=int8``) has a *twin*, the same policy with the optimizer's float32 state
(:attr:`~mixprec.advisor.report.PolicyRun.state_twin`). It qualifies only when, besides the
above, its loss stays within ``tolerance`` of its twin's
(:attr:`~mixprec.advisor.report.PolicyRun.twin_distance`) and its state is smaller than its
twin's (a model whose every tensor is under the format's ``min_size`` keeps float32 state:
nothing saved). It competes under ``"speed"`` (where a tie goes to a policy with the
optimizer's own state: the quantization costs time and saves none of it) and ``"memory"``
(where a tie goes to the run keeping the fewest bytes of optimizer state per parameter, before
the loss distance). ``"numerics"`` ranks compute precisions, so it and "safest numerics" leave
low-bit state runs out. Every low-bit state run's line says what it saves against its twin.

How fast each runs here is also ranked apart: :func:`fastest` ("fastest here", float32
included), :func:`safest` ("safest numerics", the qualifying low-precision run closest to
float32's loss) and :func:`smallest_state` ("smallest state", the qualifying run keeping the
fewest bytes of optimizer state per parameter). :func:`verdicts` gives every run one line:
``recommended``, the float32 reference, or why it was rejected.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence

from mixprec.advisor.report import PolicyRun, state_saving
from mixprec.errors import AdviceError
from mixprec.numerics.lowbit import LOWBIT_FORMATS, parse_state_format

__all__ = [
    "DEFAULT_STATES",
    "OBJECTIVES",
    "REFERENCE",
    "TIE",
    "best_of",
    "check_objective",
    "check_states",
    "fastest",
    "loss_distance",
    "qualifies",
    "recommend",
    "rejection",
    "safest",
    "smallest_state",
    "timing_notes",
    "twin_of",
    "verdicts",
]

#: The float32 policy every other run is measured against.
REFERENCE = "O0"

#: What the recommendation optimises: the first is the default.
OBJECTIVES = ("speed", "memory", "numerics")

#: Runs whose step time (or memory) is within this fraction of the best one's are tied.
TIE = 0.10

#: The low-bit optimizer-state formats the advisor offers unless told otherwise: one more
#: short run for float32's twin, one for the recommendation's (see docs/advisor.md).
DEFAULT_STATES: tuple[str, ...] = ("int8",)


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


def rejection(
    run: PolicyRun,
    tolerance: float,
    max_skip_fraction: float,
    steps: int,
    twin: PolicyRun | None = None,
) -> str | None:
    """Why ``run`` does not qualify, in a few words; None when it does. ``twin``: a low-bit
    state run's float32-state twin (:func:`twin_of`), whose state it must undercut."""
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
    if run.state_twin is not None:
        return _twin_rejection(run, tolerance, twin)
    return None


def _twin_rejection(run: PolicyRun, tolerance: float, twin: PolicyRun | None) -> str | None:
    """Why a low-bit state run does not qualify against its float32-state twin."""
    apart = run.twin_distance
    if apart is None:
        return f"its float32-state twin {run.state_twin} did not train to the end"
    if not apart <= tolerance:
        return (
            f"loss distance {apart:.3f} from its float32-state twin {run.state_twin} > "
            f"tolerance {tolerance:g}"
        )
    mine, theirs = run.state_bytes, None if twin is None else twin.state_bytes
    if mine is not None and theirs is not None and mine >= theirs:
        return f"its state is no smaller than {run.state_twin}'s"
    return None


def twin_of(run: PolicyRun, runs: Sequence[PolicyRun]) -> PolicyRun | None:
    """The float32-state twin of a low-bit state run among ``runs``; None for other runs."""
    if run.state_twin is None:
        return None
    return next((r for r in runs if r.policy == run.state_twin), None)


def qualifies(
    run: PolicyRun,
    tolerance: float,
    max_skip_fraction: float,
    steps: int,
    twin: PolicyRun | None = None,
) -> bool:
    """True when ``run`` may be recommended (see the module docstring)."""
    return rejection(run, tolerance, max_skip_fraction, steps, twin) is None


def _time(run: PolicyRun) -> float:
    return run.median_time or math.inf


def _qualified(
    runs: Sequence[PolicyRun], tolerance: float, max_skip_fraction: float, steps: int
) -> list[PolicyRun]:
    return [r for r in runs if qualifies(r, tolerance, max_skip_fraction, steps, twin_of(r, runs))]


def _state(run: PolicyRun) -> float:
    per = run.state_bytes_per_param
    return math.inf if per is None else per


def _tie_key(
    run: PolicyRun, cautioned: Collection[str], order: Sequence[PolicyRun], objective: str
) -> tuple[bool, float, float, int]:
    """Not cautioned first; then, for memory, the least optimizer state, else the
    optimizer's own state before a low-bit one; then closest to float32; then earliest."""
    distance = run.loss_distance if run.loss_distance is not None else math.inf
    second = _state(run) if objective == "memory" else float(run.state_twin is not None)
    return (run.policy in cautioned, second, distance, order.index(run))


def best_of(
    pool: Sequence[PolicyRun],
    measure: Callable[[PolicyRun], float],
    cautioned: Collection[str],
    order: Sequence[PolicyRun],
    low: Callable[[PolicyRun], float] | None = None,
    objective: str = "speed",
) -> PolicyRun:
    """The run of ``pool`` with the smallest ``measure``; among those within :data:`TIE` of
    it, the one the tie rule of ``objective`` prefers (not cautioned; for memory the least
    optimizer state, else the optimizer's own state before a low-bit one; closest to
    float32's loss; earliest in ``order``). With ``low`` (a run's fastest step), a run is
    also tied when its fastest step is within that band: on a busy machine its range
    overlaps the best one's."""
    least = min(measure(r) for r in pool)
    band = least * (1 + TIE)
    tied = [r for r in pool if measure(r) <= band or (low is not None and low(r) <= band)]
    return min(tied, key=lambda r: _tie_key(r, cautioned, order, objective))


def _fastest_step(run: PolicyRun) -> float:
    return min(run.step_times) if run.step_times else math.inf


def _memory(run: PolicyRun) -> float:
    return math.inf if run.peak_memory is None else float(run.peak_memory)


def check_objective(objective: str) -> str:
    """``objective`` if it is one of :data:`OBJECTIVES`; else :class:`AdviceError`."""
    if objective not in OBJECTIVES:
        raise AdviceError(
            f"objective must be one of {', '.join(map(repr, OBJECTIVES))}, got {objective!r}; "
            "'speed' (the default) picks the fastest policy on this machine"
        )
    return objective


def check_states(states: str | Sequence[str] | None) -> list[str]:
    """The low-bit state formats of ``states``, canonical and once each: a format name
    (``"int8"``, ``"int4"``, ``"fp8"``) with its settings if any (``"int8(min_size=0)"``);
    a single string is one format, and None, ``()`` or ``"none"`` mean none.

    :raises AdviceError: an item that names no low-bit format.
    :raises PolicyError: a low-bit format with a bad setting.
    """
    if states is None:
        return []
    items = [states] if isinstance(states, str) else list(states)
    out: list[str] = []
    for item in items:
        text = str(item).strip()
        if text.lower() in ("", "none") and len(items) == 1:
            return []
        fmt = parse_state_format(text)
        if fmt is None:
            raise AdviceError(
                f"states: {item!r} names no low-bit state format; use one of "
                f"{', '.join(LOWBIT_FORMATS)} (settings in parentheses, 'int8(min_size=0)'), "
                "or states=() to offer none"
            )
        if str(fmt) not in out:
            out.append(str(fmt))
    return out


def recommend(
    runs: Sequence[PolicyRun],
    tolerance: float,
    max_skip_fraction: float,
    steps: int,
    objective: str = "speed",
    cautioned: Collection[str] = (),
) -> tuple[str, str]:
    """The policy that best meets ``objective`` among the qualifying runs, and the reason
    (see the module docstring); float32 (``O0``) when nothing else qualifies."""
    check_objective(objective)
    policy, reason = _recommend(runs, tolerance, max_skip_fraction, steps, objective, cautioned)
    chosen = next((r for r in runs if r.policy == policy), None)
    twin = None if chosen is None else twin_of(chosen, runs)
    if chosen is not None and twin is not None:
        reason += (
            f"; its optimizer state in low bits: {state_saving(chosen, twin)}, loss distance "
            f"{chosen.twin_distance or 0.0:.3f} from {twin.policy}'s"
        )
    return policy, reason


def _recommend(
    runs: Sequence[PolicyRun],
    tolerance: float,
    max_skip_fraction: float,
    steps: int,
    objective: str,
    cautioned: Collection[str],
) -> tuple[str, str]:
    qualified = _qualified(runs, tolerance, max_skip_fraction, steps)
    order = list(runs)
    base = next((r for r in runs if r.policy == REFERENCE and r.median_time), None)
    healthy = f"loss within {tolerance:g} of float32's, at most {max_skip_fraction:.0%} skipped"
    tie = f"ties within {TIE:.0%} go to the run closest to float32's loss"
    lowp = [r for r in qualified if r.policy != REFERENCE]
    compute = [r for r in lowp if r.state_twin is None]  # low-bit state runs: not numerics'
    if not lowp or (objective == "numerics" and not compute):
        return REFERENCE, (
            "no low-precision policy trained within tolerance; float32 is the safe choice"
        )
    if objective == "numerics":
        best = min(compute, key=lambda r: _tie_key(r, cautioned, order, objective))
        speed = ""
        if base is not None and best.median_time:
            speed = f"; {_time(base) / best.median_time:.2f}x float32's speed here"
        return best.policy, (
            f"objective numerics: of {len(compute)} low-precision policies with {healthy}, the "
            f"closest to float32's loss (distance {best.loss_distance or 0.0:.3f}){speed}"
        )
    if objective == "memory":
        pool = [r for r in qualified if r.peak_memory is not None]
        if not pool:
            return REFERENCE, "objective memory: no run's memory was measured; float32 stays"
        best = best_of(pool, _memory, cautioned, order, objective=objective)
        return best.policy, (
            f"objective memory: the smallest peak memory ({_mib(best.peak_memory)}) of "
            f"{len(pool)} policies with {healthy}; ties within {TIE:.0%} go to the run keeping "
            "the least optimizer state, then to the one closest to float32's loss"
        )
    best = best_of([r for r in qualified if r.median_time], _time, cautioned, order, _fastest_step)
    if best.policy == REFERENCE:
        quickest = min(compute or lowp, key=_time)
        return REFERENCE, (
            f"objective speed: no low-precision policy is over {TIE:.0%} faster than float32 "
            f"on this machine (the fastest, {quickest.policy}, runs at "
            f"{_time(best) / _time(quickest):.2f}x float32's speed); objective 'numerics' "
            "names the one to train in where low precision is fast"
        )
    speed = ""
    if base is not None and best.median_time:
        speed = f", {_time(base) / best.median_time:.2f}x float32's speed here"
    return best.policy, (
        f"objective speed: the fastest of {len(qualified)} policies with {healthy}{speed}; {tie}"
    )


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f} MiB"


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
        r
        for r in _qualified(runs, tolerance, max_skip_fraction, steps)
        if r.policy != REFERENCE and r.state_twin is None
    ]
    if not lowp:
        return None
    return min(lowp, key=lambda r: (r.loss_distance or 0.0, _time(r))).policy


def smallest_state(
    runs: Sequence[PolicyRun], tolerance: float, max_skip_fraction: float, steps: int
) -> str | None:
    """ "Smallest state": the qualifying run keeping the fewest bytes of optimizer state per
    parameter between steps (float32 included; on equal bytes the one closest to float32's
    loss, then the earlier); None when no qualifying run measured its state."""
    pool = [
        r
        for r in _qualified(runs, tolerance, max_skip_fraction, steps)
        if r.state_bytes_per_param is not None
    ]
    if not pool:
        return None
    order = list(runs)
    return min(pool, key=lambda r: (_state(r), r.loss_distance or 0.0, order.index(r))).policy


def verdicts(
    runs: Sequence[PolicyRun],
    recommended: str,
    tolerance: float,
    max_skip_fraction: float,
    steps: int,
    objective: str = "speed",
    cautioned: Collection[str] = (),
) -> list[str]:
    """One line per run, in order: ``"recommended"``, the float32 reference, or
    ``"rejected: <why>"`` (for a run that qualified: what the recommended one does better,
    by ``objective``)."""
    chosen = next((r for r in runs if r.policy == recommended), None)
    quickest = fastest(runs, tolerance, max_skip_fraction, steps)
    lines = []
    for run in runs:
        twin = twin_of(run, runs)
        why = rejection(run, tolerance, max_skip_fraction, steps, twin)
        if run.policy == recommended:
            line = "recommended"
        elif run.policy == REFERENCE:
            line = "float32 reference" + (f", and {why}" if why else "")
        elif why is not None:
            line = f"rejected: {why}"
        else:
            line = "rejected: " + _lost(run, chosen, recommended, objective, cautioned)
        if run.policy == quickest and run.policy != recommended:
            line += "; fastest here"
        lines.append(line)  # a low-bit run's saving: its own line under the table
    return lines


def _lost(
    run: PolicyRun,
    chosen: PolicyRun | None,
    recommended: str,
    objective: str,
    cautioned: Collection[str],
) -> str:
    """Why a qualifying run lost to ``chosen`` under ``objective``."""
    if chosen is None:
        return f"{recommended} was preferred"
    if objective == "numerics" and run.state_twin is not None:
        return "objective numerics ranks compute precisions, not the optimizer's state"
    if objective == "numerics":
        return (
            f"loss distance {run.loss_distance or 0.0:.3f}, {recommended}'s "
            f"{chosen.loss_distance or 0.0:.3f}"
        )
    if objective == "memory":
        mine, best = _memory(run), _memory(chosen)
        if mine <= best * (1 + TIE):
            if run.policy in cautioned and recommended not in cautioned:
                why = "the docs warn about it"
            elif _state(run) > _state(chosen):
                why = f"{recommended} keeps less optimizer state"
            elif (run.loss_distance or 0.0) > (chosen.loss_distance or 0.0):
                why = "farther from float32's loss"
            else:
                why = "a later candidate"
            return (
                f"{_mib(run.peak_memory)}, as small as {recommended}'s "
                f"{_mib(chosen.peak_memory)} within {TIE:.0%} (a tie); {why}"
            )
        return f"{_mib(run.peak_memory)}, {recommended} {_mib(chosen.peak_memory)}"
    if chosen.median_time and run.median_time:
        ratio = run.median_time / chosen.median_time
        if ratio <= 1 + TIE or _fastest_step(run) <= chosen.median_time * (1 + TIE):
            if run.policy in cautioned and recommended not in cautioned:
                why = "the docs warn about it"
            elif run.state_twin is not None and chosen.state_twin is None:
                why = "its low-bit state saves no time"
            elif (run.loss_distance or 0.0) > (chosen.loss_distance or 0.0):
                why = "farther from float32's loss"
            else:
                why = "a later candidate"
            return f"as fast as {recommended} within {TIE:.0%} (a tie); {why}"
        return f"{ratio:.2f}x slower than {recommended}"
    return f"slower than {recommended}"


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
