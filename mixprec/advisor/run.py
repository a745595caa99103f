"""The precision advisor's run: candidates, short training runs, module rules, the advice.

Backends implement two small protocols, :class:`AdviceTarget` (makes copies of the user's
model under a policy and measures module errors) and :class:`Trainee` (one copy, stepped);
:func:`run_advice` does the rest the same way for every backend:

1. train a copy under float32 (``O0``) and under every candidate, on the same batches;
2. measure each module of the fastest low-precision candidate against float32, and add
   ``float32`` module rules, most sensitive module first, until every module's added error is
   under ``threshold`` (at most ``max_rules``); when that candidate runs FP8 layers, the
   layers its FP8 what-if statistics find fragile are first kept in its compute dtype
   (``path:<layer>=bfloat16``, :func:`fp8_rules`);
3. train the tuned policy too, and recommend, among the policies whose loss stays within
   ``tolerance`` of float32's with few skipped steps, the one that best meets the
   ``objective``: ``"speed"`` (the default: the fastest here, float32 included), ``"memory"``
   or ``"numerics"`` (the low-precision policy closest to float32's loss), with ties within
   the noise broken by a stated rule (:mod:`mixprec.advisor.verdicts`);
4. for each low-bit optimizer-state format of ``states`` (``int8`` by default), train the
   low-bit state twin of float32 (``O0,state=int8``) and of that recommendation
   (``O2-bf16,state=int8``), where the policy takes one and the backend builds it,
   and recommend again with them among the runs: a low-bit state run qualifies only when
   its loss also stays within ``tolerance`` of its float32-state twin's, and its line says
   what it saves. A candidate named with a low-bit state has its twin trained too.

Every run reports its optimizer state between steps per parameter, when the trainee
measures it (its optional ``state_bytes()``).

Warnings the copies raise (a ``RepeatedSkipWarning`` of a candidate that skips, a slow
bfloat16 warning of ``wrap``) are the candidates' findings: they go into the report's notes,
once each, not onto the terminal. Progress goes to stderr: a tqdm bar on a terminal, one
line per candidate otherwise (piped, or in CI).

A policy with a dynamic loss scale is calibrated first: a throwaway copy steps on the first
``warmup`` batches, each again while its step is skipped, and the run starts from the scale
that copy settled on. So the backoffs every float16 run makes at its start (from 65536 down
to what the gradients fit) neither count as skipped steps nor leave the run's first steps
untrained, and the report says how many there were.

Pure Python: the frameworks stay in the backends, tqdm is imported only to draw the bar.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from mixprec.advisor.report import AdviceReport, ModuleSensitivity, PolicyRun
from mixprec.advisor.verdicts import (
    DEFAULT_STATES,
    OBJECTIVES,
    REFERENCE,
    best_of,
    check_objective,
    check_states,
    fastest,
    loss_distance,
    recommend,
    safest,
    smallest_state,
    timing_notes,
    verdicts,
)
from mixprec.backend import Capabilities, DeviceCapability
from mixprec.engine.spec import get_policy
from mixprec.errors import AdviceError, PolicyError
from mixprec.numerics.loss_scale import DynamicScale
from mixprec.numerics.lowbit import parse_state_format
from mixprec.policy.presets import BUILTIN_PRESETS
from mixprec.policy.value import Policy

__all__ = [
    "DEFAULT_STATES",
    "OBJECTIVES",
    "AdviceError",
    "AdviceTarget",
    "Trainee",
    "candidate_policies",
    "cautioned",
    "check_states",
    "float32_state_twin",
    "fp8_rules",
    "loss_distance",
    "low_bit_variant",
    "propose_rule",
    "recommend",
    "run_advice",
    "timing_notes",
]

RSS_MEASURE = "peak resident memory (RSS) growth of the process while the copy trained"

#: At most this many skipped calibration steps (65536 down to 256): fewer than the step
#: guard's RepeatedSkipWarning takes, and more than any scale-only warm-up needs.
CALIBRATION_SKIPS = 8


class Trainee(Protocol):
    """One copy of the user's model and optimizer under one policy.

    Optional: ``state_bytes() -> tuple[int, int] | None``, the bytes of the optimizer's
    state between steps and the parameter elements it updates (the report's
    ``state B/param``); a trainee without it leaves the column empty.
    """

    def step(self, batch: Any) -> float:
        """One training step (forward, backward, optimizer step) on ``batch``, finished on
        the device; return the loss as a float."""

    def loss_scale(self) -> float:
        """The loss scale now (1.0 without scaling)."""

    def skipped_steps(self) -> int:
        """Steps skipped so far because gradients overflowed."""

    def underflow_fraction(self) -> float | None:
        """Mean over parameters of the gradient underflow fraction of the latest step."""

    def peak_memory(self) -> int | None:
        """Peak bytes the backend measured itself (a GPU), or None to measure RSS."""


class AdviceTarget(Protocol):
    """A backend's view of the user's model: copies under a policy, module errors.

    A low-bit state twin the advisor offers (:func:`low_bit_variant`) is built with
    :meth:`start` once first: where that raises (a backend or optimizer without low-bit
    state), the twin is not offered and a note says why.
    """

    backend: str
    device: str

    def capabilities(self) -> Capabilities:
        """The backend's ``capabilities()``."""

    def memory_measure(self) -> str:
        """What :meth:`Trainee.peak_memory` measures, or :data:`RSS_MEASURE`."""

    def start(self, policy: str) -> Trainee:
        """A fresh copy of the model and optimizer wrapped under ``policy``."""

    def sensitivity(self, policy: str, batch: Any) -> list[ModuleSensitivity]:
        """Each module's error under ``policy`` against float32 on ``batch``, same weights."""


def candidate_policies(caps: Capabilities, device: str) -> list[str]:
    """The built-in presets ``device`` can compute in (``O0`` first), as the default list.

    The compensated presets (``O3-bf16-kahan``, ``O3-bf16-sr``) are left out: not every
    backend runs them; name them in ``candidates`` to compare them. The FP8 presets
    (``O1-fp8``, ``O2-fp8``) are in where the device lists their recipe; name other recipes
    (``"O1-fp8,fp8=rowwise"``) to compare them, or read ``mixprec.torch.fp8_statistics``.
    """
    cap = caps.device(device)
    names = [n for n in BUILTIN_PRESETS if n not in ("O0", "auto")]
    return ["O0", *(n for n in names if _runs(get_policy(n), cap))]


def cautioned(policies: Sequence[str]) -> list[str]:
    """The policies the docs warn about (the home page's ``O3`` rows): low-precision weights
    with neither float32 masters nor a compensated update, whose small updates can round
    away. A tie in the recommendation never goes to one of them."""
    out = []
    for name in policies:
        policy = get_policy(name)
        if policy.param != "float32" and policy.master is None and policy.master_strategy is None:
            out.append(name)
    return out


def low_bit_variant(policy: str, fmt: str) -> str | None:
    """``policy`` keeping its optimizer state in ``fmt``: ``"O2-bf16,state=int8"`` for a
    preset (short enough for the report's table, and read back by ``get_policy``), the
    canonical spec otherwise; None when ``policy`` keeps a state of its own already or takes
    no low-bit state (low-precision weights without masters: ``O3``, ``O3-bf16``)."""
    chosen = get_policy(policy)
    if chosen.state is not None:
        return None
    try:
        variant = get_policy(chosen, state=fmt)
    except PolicyError:
        return None
    if str(chosen) == policy and "," not in policy and "=" not in policy:  # a preset's name
        return f"{policy},state={variant.state}"
    return str(variant)


def float32_state_twin(policy: str) -> str | None:
    """The twin of a policy keeping a low-bit optimizer state: the same policy with the
    optimizer's own state, as the canonical spec; None for any other policy."""
    chosen = get_policy(policy)
    if chosen.state is None or parse_state_format(chosen.state) is None:
        return None
    return str(get_policy(chosen, state="none"))


def _runs(policy: Policy, cap: DeviceCapability) -> bool:
    """Whether a preset is a default candidate on a device: its compute dtype and its FP8
    recipe listed there, no compensated strategy."""
    fp8 = policy.fp8 is None or policy.fp8.name in cap.fp8_recipes
    return policy.compute in cap.compute_dtypes and policy.master_strategy is None and fp8


def propose_rule(
    worst: ModuleSensitivity, ranked: Sequence[ModuleSensitivity], threshold: float
) -> str:
    """The module rule that keeps ``worst`` in float32: a class rule when every module of
    its class (two or more) is over ``threshold``, else a path rule for it alone."""
    same = [s for s in ranked if s.module_class == worst.module_class]
    if len(same) > 1 and all(not s.added_error <= threshold for s in same):
        return f"class:{worst.module_class}=float32"
    return f"path:{worst.module}=float32"


def fp8_rules(target: AdviceTarget, policy: str, batch: Any) -> tuple[list[str], set[str]]:
    """Under an ``fp8`` policy, the rules that keep its FP8-fragile layers in the compute
    dtype, and every FP8 layer, from the target's what-if statistics (its optional method
    ``fp8_statistics(policy, batch)`` returning a
    :class:`mixprec.numerics.fp8.stats.FP8Statistics`); nothing for other policies or targets
    without the method."""
    chosen = get_policy(policy)
    measure = getattr(target, "fp8_statistics", None)
    if chosen.fp8 is None or measure is None:
        return [], set()
    stats = measure(policy, batch)
    layers = {layer for layer in stats.layers if chosen.fp8_for(layer, "Linear") is not None}
    fragile = [layer for layer in stats.fragile(chosen.fp8.name) if layer in layers and layer]
    return [f"path:{layer}={chosen.compute}" for layer in fragile], layers


def _ranked(rows: Sequence[ModuleSensitivity]) -> list[ModuleSensitivity]:
    """Most added error first; on a tie the deeper module (a container that only passes on
    its child's error must not take the blame, nor a rule pinning all its children)."""

    def key(s: ModuleSensitivity) -> tuple[float, int, float]:
        added = math.inf if math.isnan(s.added_error) else s.added_error
        grad = math.inf if math.isnan(s.grad_error) else s.grad_error
        return (-added, -s.module.count("."), -grad)

    return sorted((s for s in rows if s.module), key=key)  # the root cannot take a path rule


class _Lines:
    """Progress as one line per candidate on stderr, where no bar is drawn (piped output)."""

    def __init__(self, desc: str) -> None:
        self.desc = desc

    def say(self, text: str) -> None:
        print(f"{self.desc}: {text}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _progress(total: int, desc: str, show: bool | None) -> Iterator[tuple[Any, _Lines | None]]:
    """``(bar, lines)``: a tqdm bar on stderr on a terminal, else one line per candidate;
    ``show=True`` asks for the bar (lines when tqdm is missing), ``False`` for neither."""
    bar: Any = None
    lines: _Lines | None = None
    if show is None:
        show = sys.stderr.isatty()
        lines = None if show else _Lines(desc)
    if show:
        try:
            from tqdm.auto import tqdm  # type: ignore[import-untyped]
        except ImportError:  # the bar is a nicety: pip install 'mixprec[advise]'
            lines = _Lines(desc)
        else:
            bar = tqdm(total=total, desc=desc, unit="step", leave=True, file=sys.stderr)
    try:
        yield bar, lines
    finally:
        if bar is not None:
            bar.close()


@contextlib.contextmanager
def _findings(notes: list[str], policy: str) -> Iterator[None]:
    """Warnings raised inside go into ``notes`` (once per policy, kind and message, with a
    count), not onto the terminal: a candidate's warnings are findings about it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    counts: dict[str, int] = {}
    for warning in caught:
        first = str(warning.message).strip().splitlines()[0] if str(warning.message) else ""
        said = f"{warning.category.__name__}: {first}"
        counts[said] = counts.get(said, 0) + 1
    for said, n in counts.items():
        if any(note.endswith(said) or f"{said} (" in note for note in notes):
            continue  # the same finding under another policy: once is enough
        notes.append(f"{policy}: {said}" + (f" ({n} times)" if n > 1 else ""))


def _summary(run: PolicyRun) -> str:
    """One line on a finished run, for the piped progress."""
    if not run.ok:
        return run.status
    said = []
    if run.median_time is not None:
        said.append(f"{1e3 * run.median_time:.1f} ms a step")
    if run.loss_distance is not None:
        said.append(f"loss distance {run.loss_distance:.3f}")
    if run.skipped_steps:
        said.append(f"{run.skipped_steps} skipped")
    return ", ".join(said) or "done"


def _status_kb(field: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text(encoding="ascii")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux: write 5 to /proc/self/clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5", encoding="ascii")
    except OSError:
        return False
    return True


def _calibrate(
    target: AdviceTarget, policy: str, batches: Sequence[Any], warmup: int, run: PolicyRun
) -> tuple[str, str | None]:
    """The spec the run starts from (``policy`` with a calibrated initial loss scale) and a
    note when the warm-up found no scale (then the skips are the policy's numerics)."""
    config = get_policy(policy).loss_scale
    if not isinstance(config, DynamicScale):
        return policy, None
    try:
        trainee = target.start(policy)
        done = 0
        while done < max(1, warmup):
            scale = trainee.loss_scale()
            loss = trainee.step(batches[done % len(batches)])
            run.warmup_steps += 1
            if not math.isfinite(loss):
                return policy, (
                    f"{policy}: its loss is not finite from the first step, so its skipped steps "
                    "are its numerics, not the loss scale's warm-up"
                )
            if trainee.skipped_steps() > run.warmup_skips:
                run.warmup_skips += 1
                if run.warmup_skips >= CALIBRATION_SKIPS or scale * config.backoff < config.min:
                    return policy, (
                        f"{policy}: the loss scale found no finite step in {run.warmup_skips} "
                        "warm-up steps, so its skipped steps are its numerics"
                    )
                continue
            done += 1
    except Exception:  # the run itself meets the same failure and reports it
        return policy, None
    if run.warmup_skips == 0:
        return policy, None
    run.initial_scale = scale
    calibrated = dataclasses.replace(config, init=scale)
    return str(get_policy(policy, loss_scale=calibrated)), None


def _train(
    target: AdviceTarget,
    policy: str,
    batches: Sequence[Any],
    steps: int,
    warmup: int,
    bar: Any,
    notes: list[str],
) -> PolicyRun:
    run = PolicyRun(policy)
    if bar is not None:
        bar.set_postfix_str(policy)
    with _findings(notes, policy):
        return _train_copy(target, run, batches, steps, warmup, bar, notes)


def _train_copy(
    target: AdviceTarget,
    run: PolicyRun,
    batches: Sequence[Any],
    steps: int,
    warmup: int,
    bar: Any,
    notes: list[str],
) -> PolicyRun:
    spec, note = _calibrate(target, run.policy, batches, warmup, run)
    if note is not None:
        notes.append(note)
    rss_start = _status_kb("VmRSS") if _reset_peak_rss() else None
    try:
        trainee = target.start(spec)
        for i in range(steps):
            start = time.perf_counter()
            loss = trainee.step(batches[i % len(batches)])
            elapsed = time.perf_counter() - start
            if i >= warmup:
                run.step_times.append(elapsed)
            run.losses.append(loss)
            run.loss_scales.append(trainee.loss_scale())
            if bar is not None:
                bar.update(1)
        run.skipped_steps = trainee.skipped_steps()
        run.underflow_fraction = trainee.underflow_fraction()
        run.peak_memory = trainee.peak_memory()
        measure = getattr(trainee, "state_bytes", None)
        counted = measure() if callable(measure) else None
        if counted is not None:
            run.state_bytes, run.parameters = counted
    except Exception as exc:  # a candidate this machine cannot run is a finding, not a crash
        # MXNet puts a C++ traceback first: its last line is the reason
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [""]
        reason = lines[-1]
        if not reason.startswith(type(exc).__name__):
            reason = f"{type(exc).__name__}: {reason}"
        run.status = f"failed: {reason}"
        if bar is not None:
            bar.update(steps - len(run.losses))
        return run
    peak = _status_kb("VmHWM")
    if run.peak_memory is None and rss_start is not None and peak is not None:
        run.peak_memory = max(0, peak - rss_start)
    return run


def _warm_up(target: AdviceTarget, batch: Any) -> None:
    """One untimed float32 step, so that the first candidate does not pay for the
    framework's one-time setup (kernel selection, allocator pools) in time and memory."""
    with contextlib.suppress(Exception), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a real failure or warning shows up in the O0 run
        target.start("O0").step(batch)


def _check(candidates: Sequence[str], batches: Sequence[Any], steps: int, tolerance: float,
           threshold: float, objective: str) -> list[str]:  # fmt: skip
    check_objective(objective)
    if steps < 1:
        raise AdviceError(f"steps must be at least 1, got {steps}; pass steps=20 or so")
    if len(batches) == 0:
        raise AdviceError("batches is empty; pass a list of the batches to train on")
    if not (tolerance > 0 and threshold > 0):
        raise AdviceError(
            f"tolerance and threshold must be positive, got {tolerance} and {threshold}"
        )
    names = [str(c) for c in candidates]
    for name in names:
        get_policy(name)  # raises PolicyError naming the bad spec before anything runs
    out = ["O0"]
    for name in dict.fromkeys(names):
        twin = float32_state_twin(name)  # a low-bit state is judged against its twin
        for spec in (twin, name) if twin is not None else (name,):
            if all(get_policy(spec) != get_policy(known) for known in out):
                out.append(spec)
    return out


def _link_twins(runs: Sequence[PolicyRun]) -> None:
    """Name each low-bit state run's float32-state twin and its loss distance from it."""
    for run in runs:
        twin_spec = float32_state_twin(run.policy)
        if twin_spec is None:
            continue
        twin = next((r for r in runs if get_policy(r.policy) == get_policy(twin_spec)), None)
        run.state_twin = None if twin is None else twin.policy
        run.twin_distance = None
        if twin is not None and twin.ok and run.ok:
            run.twin_distance = loss_distance(run.losses, twin.losses)


def _offered(
    target: AdviceTarget, bases: Sequence[str], formats: Sequence[str], runs: Sequence[PolicyRun]
) -> tuple[list[str], list[str]]:
    """The low-bit state twins of ``bases`` to train (not among ``runs`` yet, each built by
    the target once), and a note for each format the target refused (then that format's
    later twins are not tried)."""
    offered: list[str] = []
    notes: list[str] = []
    known = [get_policy(r.policy) for r in runs]
    for fmt in formats:
        for base in dict.fromkeys(bases):
            spec = low_bit_variant(base, fmt)
            if spec is None or get_policy(spec) in known or spec in offered:
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # its run would raise them again
                    target.start(spec)
            except Exception as exc:  # a backend or an optimizer without low-bit state
                first = (str(exc).strip().splitlines() or [""])[0]
                notes.append(
                    f"state={fmt}: not offered, the {target.backend} backend refused {spec} "
                    f"({type(exc).__name__}: {first})"
                )
                break
            offered.append(spec)
    return offered, notes


def run_advice(
    target: AdviceTarget,
    batches: Sequence[Any],
    *,
    candidates: Sequence[str] | None = None,
    steps: int = 20,
    warmup: int = 2,
    tolerance: float = 0.05,
    threshold: float = 0.01,
    max_rules: int = 3,
    max_skip_fraction: float = 0.2,
    progress: bool | None = None,
    objective: str = "speed",
    states: str | Sequence[str] | None = DEFAULT_STATES,
) -> AdviceReport:
    """Train copies under each candidate, tune the fastest one with module rules, advise.

    Parameters as in ``mixprec.torch.advise``; ``batches`` must be a sequence (the same
    batches go to every candidate, cycled when there are fewer than ``steps``).
    """
    if candidates is None:
        candidates = candidate_policies(target.capabilities(), target.device)
    policies = _check(candidates, batches, steps, tolerance, threshold, objective)
    formats = check_states(states)
    warmup = min(warmup, steps - 1)
    runs: list[PolicyRun] = []
    notes: list[str] = []
    twins = 2 * len(formats)  # float32's twin and the first recommendation's, at most
    total = steps * (len(policies) + 1 + twins)
    with _progress(total, f"advise {target.backend}", progress) as (bar, lines):
        if lines is not None:
            then = f"; then state={'/'.join(formats)} twins of O0 and the advice" if formats else ""
            lines.say(
                f"{len(policies)} policies, {steps} steps each, objective {objective}: "
                + ", ".join(policies)
                + then
            )
        _warm_up(target, batches[0])
        for i, policy in enumerate(policies, 1):
            run = _train(target, policy, batches, steps, warmup, bar, notes)
            runs.append(run)
            run.loss_distance = loss_distance(run.losses, runs[0].losses) if run.ok else None
            if lines is not None:
                lines.say(f"[{i}/{len(policies)}] {policy}: {_summary(runs[-1])}")
        reference = runs[0].losses
        for run in runs:
            run.loss_distance = loss_distance(run.losses, reference) if run.ok else None
        report = AdviceReport(
            backend=target.backend,
            device=target.device,
            recommended="O0",
            reason="",
            runs=runs,
            memory_measure=target.memory_measure(),
            steps=steps,
            tolerance=tolerance,
            threshold=threshold,
            notes=notes,
            objective=objective,
            states=formats,
        )
        if lines is not None:
            lines.say("measuring module sensitivity")
        _tune(target, report, batches[0], max_rules)
        if report.tuned_policy is not None:
            tuned = _train(target, report.tuned_policy, batches, steps, warmup, bar, notes)
            tuned.loss_distance = loss_distance(tuned.losses, reference) if tuned.ok else None
            runs.append(tuned)
            if lines is not None:
                lines.say(f"[tuned] {tuned.policy}: {_summary(tuned)}")
        elif bar is not None:
            bar.update(steps)
        judged = (tolerance, max_skip_fraction, steps)
        _link_twins(runs)
        if formats:
            first, _ = recommend(runs, *judged, objective, cautioned([r.policy for r in runs]))
            offered, refused = _offered(target, [REFERENCE, first], formats, runs)
            notes.extend(refused)
            for policy in offered:
                twin = _train(target, policy, batches, steps, warmup, bar, notes)
                twin.loss_distance = loss_distance(twin.losses, reference) if twin.ok else None
                runs.append(twin)
                if lines is not None:
                    lines.say(f"[state] {policy}: {_summary(twin)}")
            if bar is not None:
                bar.update(steps * (twins - len(offered)))
            _link_twins(runs)
    warned = cautioned([run.policy for run in runs])
    report.recommended, report.reason = recommend(runs, *judged, objective, warned)
    report.fastest, report.safest = fastest(runs, *judged), safest(runs, *judged)
    report.smallest_state = smallest_state(runs, *judged)
    lines_of = verdicts(runs, report.recommended, *judged, objective, warned)
    for run, verdict in zip(runs, lines_of, strict=True):
        run.verdict = verdict
    report.recommended_toml = get_policy(report.recommended).to_toml()
    report.notes.extend(timing_notes(runs))
    return report


def _tune(target: AdviceTarget, report: AdviceReport, batch: Any, max_rules: int) -> None:
    """Measure the fastest low-precision candidate's modules and propose float32 rules."""
    fp32 = get_policy("O0")
    lowp = [  # a low-bit state changes no module's output: its twin is measured instead
        r
        for r in report.runs
        if r.ok
        and r.median_time
        and get_policy(r.policy) != fp32
        and float32_state_twin(r.policy) is None
    ]
    if not lowp:
        return
    # the fastest, with the recommendation's tie rule: the same base from identical runs
    warned = cautioned([r.policy for r in lowp])
    base = best_of(lowp, lambda r: r.median_time or math.inf, warned, report.runs).policy
    report.sensitivity_policy = base
    with _findings(report.notes, f"module sensitivity under {base}"):
        _measure(target, report, base, batch, max_rules)


def _measure(
    target: AdviceTarget, report: AdviceReport, base: str, batch: Any, max_rules: int
) -> None:
    try:
        ranked = _ranked(target.sensitivity(base, batch))
    except Exception as exc:  # measured on a best-effort basis: say why it is missing
        report.notes.append(f"module sensitivity failed: {type(exc).__name__}: {exc}")
        return
    if not ranked:
        why = getattr(target, "no_sensitivity_reason", None)
        said = why(base) if callable(why) else None
        report.notes.append(
            f"module sensitivity under {base}: no module could be measured"
            + (f" ({said})" if said else "")
        )
    report.sensitivity = ranked
    try:  # FP8-fragile layers back to the compute dtype first (per-row errors find them)
        rules, fp8_layers = fp8_rules(target, base, batch)
    except Exception as exc:
        report.notes.append(f"FP8 statistics failed: {type(exc).__name__}: {exc}")
        rules, fp8_layers = [], set()
    rules = rules[:max_rules]
    # the FP8 layers left in FP8 passed their own statistics: an FP8 GEMM's output error is
    # above float32 rules' threshold by nature, and a float32 rule would undo FP8 there
    judged = fp8_layers - {rule.partition(":")[2].rpartition("=")[0] for rule in rules}
    current = _ranked(target.sensitivity(_with_rules(base, rules), batch)) if rules else ranked
    while len(rules) < max_rules:
        over = [
            s for s in current if not s.added_error <= report.threshold and s.module not in judged
        ]
        if not over:
            break
        rule = propose_rule(over[0], current, report.threshold)
        if rule in rules:  # pinned already and still over: more rules of this kind won't help
            break
        rules.append(rule)
        current = _ranked(target.sensitivity(_with_rules(base, rules), batch))
    if rules:
        report.rules = rules
        report.tuned_policy = _with_rules(base, rules)
        report.tuned_sensitivity = current


def _with_rules(base: str, rules: Sequence[str]) -> str:
    """``base`` with module rules added, as the shortest spec ``get_policy`` reads back."""
    policy = get_policy(base)
    for rule in rules:
        match, _, rest = rule.partition(":")
        pattern, _, dtype = rest.rpartition("=")
        policy = policy.with_module(pattern, dtype, match="class" if match == "class" else "path")
    return str(policy)
