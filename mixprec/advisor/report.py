"""The precision advisor's report: what each candidate policy did, and what to use.

:class:`AdviceReport` is what ``mixprec.torch.advise`` and ``mixprec.mxnet.advise`` return
(the run itself is :func:`mixprec.advisor.run.run_advice`). It is plain data: no framework and no
NumPy here, and matplotlib is imported only inside :meth:`AdviceReport.plot`.

- :attr:`AdviceReport.recommended` is a policy string; ``mixprec.get_policy`` reads it back.
- :attr:`PolicyRun.state_bytes_per_param` is the optimizer's state between steps per
  parameter (8.0 for float32 Adam; about 2 under ``state=int8``); a run of a low-bit state
  (``state=int8``) names its float32-state twin (:attr:`PolicyRun.state_twin`).
- :meth:`AdviceReport.table` is the terminal table, :meth:`AdviceReport.to_json` the JSON
  report, :meth:`AdviceReport.write_toml` the policy file to keep, :meth:`AdviceReport.plot`
  the pictures and :meth:`AdviceReport.save` all of them in one folder.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mixprec.advisor import plots
from mixprec.atomic import atomic_write_text
from mixprec.errors import MixprecError
from mixprec.numerics.lowbit import DEFAULT_MIN_SIZE

__all__ = ["STATE_MEASURE", "AdviceReport", "ModuleSensitivity", "PolicyRun", "state_saving"]

STATE_MEASURE = (
    "optimizer state between steps per parameter (the tensors the optimizer keeps, after the "
    "last step; weights and float32 masters not counted)"
)


@dataclass
class PolicyRun:
    """One candidate policy trained on a copy of the model for a few steps.

    ``status`` is ``"ok"``, or ``"failed: <reason>"`` when building or stepping the copy
    raised (the other fields then hold what was measured before that).
    """

    policy: str
    status: str = "ok"
    step_times: list[float] = field(default_factory=list)
    """Seconds per training step (forward, backward, step), warm-up steps left out."""
    losses: list[float] = field(default_factory=list)
    """The loss of every step, on the same batches for every candidate."""
    loss_scales: list[float] = field(default_factory=list)
    """The loss scale after every step."""
    skipped_steps: int = 0
    underflow_fraction: float | None = None
    """Mean over parameters of the fraction of nonzero gradient elements below the compute
    dtype's smallest normal number, on the last step."""
    peak_memory: int | None = None
    """Bytes; see :attr:`AdviceReport.memory_measure` for what was measured."""
    loss_distance: float | None = None
    """Mean relative distance of :attr:`losses` from the float32 run's (0 for float32)."""
    warmup_steps: int = 0
    """Steps a throwaway copy ran before this run to calibrate the dynamic loss scale (the
    scaler's warm-up); 0 when the policy has no dynamic scale."""
    warmup_skips: int = 0
    """How many of the :attr:`warmup_steps` were skipped: the backoffs every float16 run
    makes at its start, not counted in :attr:`skipped_steps`."""
    initial_scale: float | None = None
    """The loss scale the run started from when the warm-up lowered it, else None."""
    state_bytes: int | None = None
    """Bytes of the optimizer's state between steps, after the last step: every tensor it
    keeps per parameter (moments, momentum; a low-bit state's codes and block scales), its
    scalar counters (Adam's ``step``) left out, and neither the weights nor float32 masters.
    None where the backend does not measure it."""
    parameters: int | None = None
    """Elements of the parameters the optimizer updates (what :attr:`state_bytes` is per)."""
    state_twin: str | None = None
    """For a run whose policy keeps a low-bit state (``state=int8``, ``int4``, ``fp8``): the
    run of the same policy with the optimizer's own float32 state, its *twin*. Such a run is
    recommended only when its loss stays within the tolerance of its twin's."""
    twin_distance: float | None = None
    """For a low-bit state run: the loss distance from its :attr:`state_twin`'s losses (the
    same measure as :attr:`loss_distance`, against the twin instead of float32)."""
    verdict: str = ""
    """One line: ``recommended``, the float32 reference, or ``rejected: <why>``."""

    @property
    def ok(self) -> bool:
        """True when the copy trained to the end without raising."""
        return self.status == "ok"

    @property
    def median_time(self) -> float | None:
        """Median seconds per step, or None when no step was timed."""
        return statistics.median(self.step_times) if self.step_times else None

    @property
    def state_bytes_per_param(self) -> float | None:
        """:attr:`state_bytes` / :attr:`parameters`: 8.0 for float32 Adam, 4.0 for float32
        SGD momentum, about 2 for int8 Adam, 1 for int4; None when not measured."""
        if self.state_bytes is None or not self.parameters:
            return None
        return self.state_bytes / self.parameters


@dataclass
class ModuleSensitivity:
    """How much error one module adds in low precision, measured against float32.

    Errors are relative (``|low - fp32| / |fp32|`` over the whole tensor) on the same inputs
    and weights; ``added_error`` is the module's output error minus its input error, which
    puts the blame on the module that creates the error rather than every one downstream.
    ``inf`` means the module produced inf or NaN where float32 did not.
    """

    module: str
    module_class: str
    output_error: float
    added_error: float
    grad_error: float


@dataclass
class AdviceReport:
    """The advisor's result. Build it with ``mixprec.torch.advise`` / ``mixprec.mxnet.advise``."""

    backend: str
    device: str
    recommended: str
    """The policy to use: ``mixprec.get_policy(report.recommended)`` reads it back."""
    reason: str
    """One sentence on why :attr:`recommended` won."""
    runs: list[PolicyRun]
    """Every candidate, float32 first, then the tuned policy (when rules were proposed)."""
    memory_measure: str
    """What :attr:`PolicyRun.peak_memory` measures on this backend and device."""
    steps: int
    tolerance: float
    """The largest loss distance from float32 a recommended policy may have."""
    threshold: float
    """The largest added module error the proposed rules aim for."""
    sensitivity_policy: str | None = None
    """The candidate whose modules were measured (the fastest low-precision one)."""
    sensitivity: list[ModuleSensitivity] = field(default_factory=list)
    """Its modules, most sensitive first."""
    rules: list[str] = field(default_factory=list)
    """Module rules (key grammar) proposed to bring every module's error under threshold."""
    tuned_policy: str | None = None
    """:attr:`sensitivity_policy` with :attr:`rules` added."""
    tuned_sensitivity: list[ModuleSensitivity] = field(default_factory=list)
    """The same measurement under :attr:`tuned_policy`: the rules' effect."""
    notes: list[str] = field(default_factory=list)
    """What could not be measured, and why."""
    recommended_toml: str = ""
    """:attr:`recommended` as a TOML policy document, written by the advisor (which resolves
    the spec; this module only holds data)."""
    fastest: str | None = None
    """"Fastest here": the qualifying run with the smallest median step time, float32
    included (on a CPU without fast float16 or bfloat16 it is float32)."""
    safest: str | None = None
    """"Safest numerics": the qualifying low-precision run closest to float32's loss."""
    objective: str = "speed"
    """What :attr:`recommended` optimises: ``"speed"`` (the fastest policy on this machine,
    float32 included), ``"memory"`` or ``"numerics"`` (the low-precision policy closest to
    float32's loss); see :mod:`mixprec.advisor.verdicts`."""
    states: list[str] = field(default_factory=list)
    """The low-bit state formats offered (``["int8"]`` by default): each one's twin of
    float32 (``O0,state=int8``) and of the first recommendation was trained too."""
    smallest_state: str | None = None
    """"Smallest state": the qualifying run keeping the fewest optimizer-state bytes per
    parameter between steps (float32's run included); None when no run measured it."""

    # ------------------------------------------------------------------ lookups

    def run(self, policy: str) -> PolicyRun:
        """The run of ``policy`` (as it appears in :attr:`runs`)."""
        for run in self.runs:
            if run.policy == policy:
                return run
        known = ", ".join(r.policy for r in self.runs)
        raise MixprecError(f"no run of policy {policy!r} in this report; runs: {known}")

    # ------------------------------------------------------------------ formats

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain data (``inf`` and NaN become the strings ``"inf"`` and
        ``"nan"``: JSON has neither); each run also carries its ``state_bytes_per_param``."""
        data = asdict(self)
        for run, row in zip(self.runs, data["runs"], strict=True):
            row["state_bytes_per_param"] = run.state_bytes_per_param
        return _finite(data)  # type: ignore[no-any-return]

    def to_json(self, indent: int | None = 2) -> str:
        """The report as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    def policy_toml(self) -> str:
        """The recommended policy as a TOML document (``mixprec.load_toml`` reads it back)."""
        if not self.recommended_toml:
            raise MixprecError(
                "this report carries no policy file (recommended_toml is empty); reports made "
                "by advise() have one, or write mixprec.get_policy(report.recommended).to_toml()"
            )
        return self.recommended_toml

    def write_toml(self, path: str | os.PathLike[str]) -> Path:
        """Write :meth:`policy_toml` to ``path``; return the path."""
        out = Path(path)
        atomic_write_text(out, self.policy_toml())
        return out

    def table(self) -> str:
        """The terminal table: one row per policy, then the module ranking and the advice."""
        head = ("policy", "status", "step ms (min-max)", "memory", "state B/param", "skipped",
                "scale", "underflow")  # fmt: skip
        rows = [(*head, "loss dist", "verdict")]
        for run in self.runs:
            times = "-"
            if run.step_times:
                lo, hi = min(run.step_times), max(run.step_times)
                times = f"{1e3 * (run.median_time or 0):.1f} ({1e3 * lo:.1f}-{1e3 * hi:.1f})"
            scale = f"{run.loss_scales[-1]:g}" if run.loss_scales else "-"
            rows.append(
                (
                    run.policy,
                    run.status if len(run.status) <= 60 else run.status[:57] + "...",
                    times,
                    _bytes(run.peak_memory),
                    _num(run.state_bytes_per_param, "{:.2f}"),
                    _skipped(run),
                    scale,
                    _num(run.underflow_fraction, "{:.1%}"),
                    _num(run.loss_distance, "{:.3f}"),
                    run.verdict or "-",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append(f"memory: {self.memory_measure}")
        if any(run.state_bytes is not None for run in self.runs):
            lines.append(f"state: {STATE_MEASURE}")
        lines.extend(_warmup_lines(self.runs))
        lines.extend(_twin_lines(self.runs, self.tolerance))
        if self.sensitivity_policy:
            lines.append("")
            lines.append(f"module sensitivity under {self.sensitivity_policy} (vs float32):")
            if self.sensitivity:
                lines.extend(_sensitivity_lines(self.sensitivity, self.tuned_sensitivity))
            else:
                lines.append("  no module measured (the notes say why)")
        if self.rules:
            lines.append(f"proposed rules: {', '.join(self.rules)}")
            lines.append(f"tuned policy:   {self.tuned_policy}")
        lines.extend(f"note: {note}" for note in self.notes)
        lines.append("")
        lines.append(f"objective: {self.objective}")
        lines.append(f"recommended: {self.recommended}  ({self.reason})")
        lines.extend(self._ranking_lines())
        return "\n".join(lines)

    def _ranking_lines(self) -> list[str]:
        lines = []
        times = {r.policy: r.median_time for r in self.runs}
        if self.fastest is not None:
            said = f"fastest here: {self.fastest}"
            best, chosen = times.get(self.fastest), times.get(self.recommended)
            if best and chosen and self.fastest != self.recommended:
                said += (
                    f"  ({1e3 * best:.1f} ms a step, {chosen / best:.2f}x faster than the "
                    "recommended policy on this machine)"
                )
            lines.append(said)
        if self.safest is not None:
            run = self.run(self.safest)
            lines.append(
                f"safest numerics: {self.safest}  (loss distance "
                f"{_num(run.loss_distance, '{:.3f}')})"
            )
        if self.smallest_state is not None:
            run = self.run(self.smallest_state)
            said = f"smallest state: {self.smallest_state}  ({_per_param(run)} of optimizer state"
            base = next((r for r in self.runs if r.policy == "O0"), None)
            if base is not None and base is not run and base.state_bytes_per_param:
                said += f", float32's {_per_param(base)}"
            lines.append(said + ")")
        return lines

    def __str__(self) -> str:
        return self.table()

    # ------------------------------------------------------------------ files

    def plot(self, folder: str | os.PathLike[str]) -> list[Path]:
        """Write the PNG plots into ``folder`` (created if missing); return their paths.

        ``time_vs_distance.png`` (median step time against loss distance per policy),
        ``loss_curves.png``, ``loss_scale.png`` and ``sensitivity.png`` (the per-module added
        error before and after the proposed rules). Needs matplotlib (``mixprec[advise]``).
        """
        return plots.plot_report(self, Path(folder))

    def save(self, folder: str | os.PathLike[str], *, plots: bool = True) -> dict[str, Path]:
        """Write ``report.json``, ``recommended.toml``, ``report.txt`` and (unless ``plots``
        is False) the plots into ``folder``; return the paths by name."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"json": out / "report.json", "toml": out / "recommended.toml"}
        atomic_write_text(paths["json"], self.to_json())
        self.write_toml(paths["toml"])
        paths["table"] = out / "report.txt"
        atomic_write_text(paths["table"], self.table() + "\n")
        for path in self.plot(out) if plots else []:
            paths[path.stem] = path
        return paths


def _sensitivity_lines(
    before: list[ModuleSensitivity], after: list[ModuleSensitivity], limit: int = 8
) -> list[str]:
    tuned = {s.module: s for s in after}
    rows: list[tuple[str, ...]] = [("module", "class", "added err", "output err", "grad err")]
    if tuned:
        rows[0] += ("added err with rules",)
    for s in before[:limit]:
        row: tuple[str, ...] = (
            s.module or "<root>",
            s.module_class,
            _num(s.added_error, "{:.2e}"),
            _num(s.output_error, "{:.2e}"),
            _num(s.grad_error, "{:.2e}"),
        )
        if tuned:
            new = tuned.get(s.module)
            row += (_num(new.added_error, "{:.2e}") if new else "-",)
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        ("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))).rstrip()
        for r in rows
    ]


def _skipped(run: PolicyRun) -> str:
    if run.warmup_skips:
        return f"{run.skipped_steps} (+{run.warmup_skips} warm-up)"
    return str(run.skipped_steps)


def _warmup_lines(runs: list[PolicyRun]) -> list[str]:
    lines = []
    for run in runs:
        if run.warmup_skips and run.initial_scale is not None:
            lines.append(
                f"warm-up: {run.policy}: {run.warmup_steps} calibration steps before the run, "
                f"{run.warmup_skips} skipped (the dynamic loss scale backing off to "
                f"{run.initial_scale:g}); the run started from that scale"
            )
    return lines


def _twin_lines(runs: list[PolicyRun], tolerance: float) -> list[str]:
    """One line per low-bit state run: its state against its twin's, and its loss."""
    lines = []
    for run in runs:
        twin = next((r for r in runs if r.policy == run.state_twin), None)
        if twin is None or not run.ok:
            continue
        said = f"low-bit state: {run.policy}: {state_saving(run, twin)}"
        if run.twin_distance is not None:
            said += (
                f"; loss distance from {twin.policy} {_num(run.twin_distance, '{:.3f}')} "
                f"(tolerance {tolerance:g})"
            )
        lines.append(said)
    return lines


def _per_param(run: PolicyRun) -> str:
    return _num(run.state_bytes_per_param, "{:.2f} B/param")


def state_saving(run: PolicyRun, twin: PolicyRun) -> str:
    """What a low-bit state run saves against its float32-state twin, in a few words:
    ``"state 2.03 B/param, 3.94x less than O0's 8.00 (96.0 KiB saved)"``."""
    mine, theirs = run.state_bytes_per_param, twin.state_bytes_per_param
    if mine is None or theirs is None or run.state_bytes is None or twin.state_bytes is None:
        return "state not measured"
    if theirs == 0:
        return f"no optimizer state to quantize ({twin.policy}'s optimizer keeps none)"
    if mine >= theirs:
        return (
            f"state {mine:.2f} B/param, no less than {twin.policy}'s {theirs:.2f} (no parameter "
            f"is quantized: each is under the format's min_size, {DEFAULT_MIN_SIZE} elements by "
            "default, or named by its keep)"
        )
    saved = _kib(twin.state_bytes - run.state_bytes)
    return (
        f"state {mine:.2f} B/param, {theirs / mine:.2f}x less than {twin.policy}'s "
        f"{theirs:.2f} ({saved} saved)"
    )


def _kib(value: int) -> str:
    if value >= 2**20:
        return f"{value / 2**20:.1f} MiB"
    return f"{value / 2**10:.1f} KiB"


def _num(value: float | None, fmt: str) -> str:
    if value is None:
        return "-"
    if math.isnan(value) or math.isinf(value):
        return str(value)
    return fmt.format(value)


def _bytes(value: int | None) -> str:
    if value is None:
        return "-"
    return f"{value / 2**20:.1f} MiB"


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
