"""The issue's targets, in one table, and their evaluation against a run's measurements.

Three kinds of target:

- ``ratio``: headline(contender) / headline(baseline) ≤ limit, both from the same case and
  group of the same run (medians for timings).
- ``value``: headline(contender) < limit (an absolute figure: ms).
- ``most``: headline(contender) ≤ limit, in the target's ``unit`` (bytes per parameter).
- ``drop``: headline(baseline) − headline(contender) ≤ limit for *every* contender listed
  (accuracy in points: the worst preset decides).

Where several contenders are listed for a ``ratio``, ``value`` or ``most`` target, the worst
decides. A target whose figures are missing (not run, or a contender failed) is "not measured".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from benchmarks import lowbit_state as lowbit
from benchmarks.accuracy import BASELINE, MIXED
from benchmarks.mxnet_step import AMP
from benchmarks.printing import find, fmt
from benchmarks.runner import Measurement

Kind = Literal["ratio", "value", "drop", "most"]


@dataclass(frozen=True)
class Target:
    id: str
    text: str  # the target in the words
    case: str
    group: str
    kind: Kind
    contenders: tuple[str, ...]
    limit: float
    baseline: str | None = None
    metric: str | None = None  # restrict to one metric of the contenders
    unit: str = "ms"  # of a ``value`` or ``most`` target's limit


@dataclass(frozen=True)
class Verdict:
    target: Target
    status: Literal["met", "missed", "not measured"]
    value: float | None
    detail: str  # the figure as text, e.g. "0.52× (412 ms / 790 ms)"


TARGETS: tuple[Target, ...] = (
    Target("torch-o1-mlp", "mixprec O1-bf16 step ≤ 1.05 × autocast+GradScaler, MLP",
           "torch_step", "mlp", "ratio", ("mixprec O1-bf16",), 1.05, "autocast+GradScaler"),
    Target("torch-o1-transformer",
           "mixprec O1-bf16 step ≤ 1.05 × autocast+GradScaler, transformer layer",
           "torch_step", "transformer", "ratio", ("mixprec O1-bf16",), 1.05,
           "autocast+GradScaler"),
    Target("torch-o2-mlp", "mixprec O2-bf16 step ≤ 0.50 × fp32, MLP",
           "torch_step", "mlp", "ratio", ("mixprec O2-bf16",), 0.50, "fp32"),
    Target("torch-kahan-o3", "mixprec O3-bf16-kahan step ≤ 1.10 × O3-bf16, MLP",
           "torch_step", "mlp", "ratio", ("mixprec O3-bf16-kahan",), 1.10, "mixprec O3-bf16"),
    Target("torch-kahan-o2", "mixprec O3-bf16-kahan step ≤ 0.85 × O2-bf16, MLP",
           "torch_step", "mlp", "ratio", ("mixprec O3-bf16-kahan",), 0.85, "mixprec O2-bf16"),
    Target("torch-sr-o3", "mixprec O3-bf16-sr step ≤ 1.15 × O3-bf16, MLP",
           "torch_step", "mlp", "ratio", ("mixprec O3-bf16-sr",), 1.15, "mixprec O3-bf16"),
    Target("mxnet-o2-amp-cnn", "mixprec.mxnet O2-bf16 ≤ 1.0 × mxnet.contrib.amp bf16, CNN",
           "mxnet_step", "cnn", "ratio", ("mixprec O2-bf16",), 1.0, AMP),
    Target("mxnet-o2-amp-mlp", "mixprec.mxnet O2-bf16 ≤ 1.0 × mxnet.contrib.amp bf16, MLP",
           "mxnet_step", "mlp", "ratio", ("mixprec O2-bf16",), 1.0, AMP),
    Target("mxnet-o2-fp32-cnn", "mixprec.mxnet O2-bf16 ≤ 0.6 × fp32 Trainer, CNN",
           "mxnet_step", "cnn", "ratio", ("mixprec O2-bf16",), 0.6, "fp32 Trainer"),
    Target("mxnet-o2-fp32-mlp", "mixprec.mxnet O2-bf16 ≤ 0.7 × fp32 Trainer, MLP",
           "mxnet_step", "mlp", "ratio", ("mixprec O2-bf16",), 0.7, "fp32 Trainer"),
    Target("step-overhead", "step overhead ≤ 0.9 × GradScaler's, 300 tensors",
           "step_overhead", "300 tensors", "ratio", ("mixprec O1",), 0.9, "GradScaler", "step"),
    Target("memory-o2", "peak memory under O2-bf16 ≤ 0.7 × fp32, activation-heavy model",
           "memory", "activations", "ratio", ("mixprec O2-bf16",), 0.7, "fp32",
           "peak tensor memory"),
    *(
        Target(f"state-memory-{p}",
               f"weights + optimizer state of {p} ≤ 0.75 × O2-bf16's, AdamW, MLP",
               "state_memory", "AdamW", "ratio", (p,), 0.75, "O2-bf16",
               "weights + optimizer state")
        for p in ("O3-bf16-kahan", "O3-bf16-sr", "O3-bf16-kahan,state=bfloat16")
    ),
    Target("state-step", "optimizer step with state=bfloat16 ≤ 1.5 × O2-bf16's, AdamW, MLP",
           "state_memory", "step only, AdamW", "ratio",
           ("O3-bf16-kahan,state=bfloat16", "O3-bf16-sr,state=bfloat16"), 1.5, "O2-bf16",
           "optimizer step only"),
    Target("import", "`import mixprec` < 100 ms",
           "startup", "import", "value", ("import mixprec",), 100.0),
    Target("wrap", "`wrap` of 1,000 modules < 1 s (slowest preset)",
           "startup", "wrap, 1,000 modules", "value", ("wrap O1-bf16", "wrap O2-bf16"), 1000.0),
    *(
        Target(f"compile-{preset[:2].lower()}-{kind}",
               f"mixprec {preset}+compile step ≤ {limit:g} × autocast+compile, {kind}",
               "compile", kind, "ratio", (f"mixprec {preset}+compile",), limit,
               "autocast+compile")
        for preset, limit in (("O1-bf16", 1.05), ("O2-bf16", 1.0))
        for kind in ("mlp", "transformer")
    ),
    *(
        Target(f"accuracy-{backend}",
               f"every mixed preset within 1 point of fp32 accuracy, {backend}",
               "accuracy", backend, "drop", MIXED[backend], 1.0, BASELINE[backend])
        for backend in ("torch", "mxnet", "numpy")
    ),
    *(
        Target(f"lowbit-loss-{policy.replace(',state=', '-')}",
               f"final loss of {policy} ≤ {limit:g} × {ref}'s (float32 state), MLP",
               "lowbit_state", lowbit.MLP, "ratio", (policy,), limit, ref, lowbit.LOSS)
        for policy, ref, limit in (
            ("O0,state=int8", "O0", 1.03), ("O2-bf16,state=int8", "O2-bf16", 1.03),
            ("O3-bf16-sr,state=int8", "O3-bf16-sr", 1.03), ("O0,state=int4", "O0", 1.10),
            ("O0,state=fp8", "O0", 1.06),
        )
    ),
    Target("lowbit-bytes-int8", "optimizer state of every state=int8 row ≤ 2.1 B/param, MLP",
           "lowbit_state", lowbit.MLP, "most",
           ("O0,state=int8", "O2-bf16,state=int8", "O3-bf16-sr,state=int8"), 2.1,
           metric=lowbit.STATE, unit="B/param"),
    Target("lowbit-bytes-int4", "optimizer state of O0,state=int4 ≤ 1.1 B/param, MLP",
           "lowbit_state", lowbit.MLP, "most", ("O0,state=int4",), 1.1,
           metric=lowbit.STATE, unit="B/param"),
    Target("lowbit-bytes-o3-sr", "weights + optimizer state of O3-bf16-sr,state=int8 ≤ 4.1 "
           "B/param, MLP", "lowbit_state", lowbit.MLP, "most", ("O3-bf16-sr,state=int8",), 4.1,
           metric=lowbit.KEPT, unit="B/param"),
    Target("lowbit-step-bnb", "optimizer step of O0,state=int8 ≤ 1.0 × bitsandbytes "
           "AdamW8bit's, MLP", "lowbit_state", lowbit.MLP, "ratio", ("O0,state=int8",), 1.0,
           lowbit.BNB, lowbit.STEP),
    Target("lowbit-step-fused", "optimizer step of O0,state=int8 ≤ 1.3 × fused float32 "
           "AdamW's, MLP", "lowbit_state", lowbit.MLP, "ratio", ("O0,state=int8",), 1.3,
           lowbit.FUSED, lowbit.STEP),
)  # fmt: skip


def evaluate(target: Target, measurements: Sequence[Measurement]) -> Verdict:
    """Whether ``target`` is met by the measurements of its case (from one run)."""
    mine = [m for m in measurements if m.case == target.case]

    def get(contender: str) -> Measurement | None:
        return find(mine, target.group, contender, target.metric)

    missing = [c for c in (*target.contenders, target.baseline) if c and not _ok(get(c))]
    if missing:
        why = "; ".join(_why(c, get(c)) for c in missing)
        return Verdict(target, "not measured", None, why)
    figures: list[tuple[float, str]] = []
    for contender in target.contenders:
        m = get(contender)
        assert m is not None and m.value is not None
        if target.kind in ("value", "most"):
            figures.append((m.value, f"{fmt(m.value)} {m.unit} ({contender})"))
            continue
        base = get(target.baseline or "")
        assert base is not None and base.value is not None
        if target.kind == "ratio":
            r = m.value / base.value
            figures.append((r, f"{r:.2f}× ({fmt(m.value)} / {fmt(base.value)} {m.unit})"))
        else:
            drop = base.value - m.value
            figures.append(
                (drop, f"{drop:+.2f} points ({contender}: {fmt(m.value)} vs {fmt(base.value)} %)")
            )
    value, detail = max(figures)
    # "under 100 ms" is strict; "≤ 1.05×", "≤ 2.1 B/param" and "within 1 point" include it
    met = value < target.limit if target.kind == "value" else value <= target.limit
    status: Literal["met", "missed"] = "met" if met else "missed"
    if target.kind == "drop":
        detail = f"worst drop {detail}"
    return Verdict(target, status, value, detail)


def evaluate_all(measurements: Sequence[Measurement], cases_run: Iterable[str]) -> list[Verdict]:
    """Every target whose case was run (the others are left out, not reported as missed)."""
    run = set(cases_run)
    return [evaluate(t, measurements) for t in TARGETS if t.case in run]


def _ok(m: Measurement | None) -> bool:
    return m is not None and m.ok


def _why(contender: str, m: Measurement | None) -> str:
    if m is None:
        return f"{contender}: no figure"
    why = m.error or "no samples"
    return f"{contender}: {why if len(why) <= 120 else why[:117] + '...'}"


def limit_text(target: Target) -> str:
    if target.kind == "ratio":
        return f"≤ {target.limit:g}× {target.baseline}"
    if target.kind == "drop":
        return f"≥ {target.baseline} − {target.limit:g} point"
    if target.kind == "most":
        return f"≤ {target.limit:g} {target.unit}"
    return f"< {target.limit:g} {target.unit}"
