"""The advisor's framework-neutral parts: candidates, loss distance, rules, recommendation
and the report's formats (no framework imported)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import mixprec
from mixprec.advisor.report import AdviceReport, ModuleSensitivity, PolicyRun
from mixprec.advisor.run import (
    candidate_policies,
    loss_distance,
    propose_rule,
    recommend,
    timing_notes,
)
from mixprec.advisor.verdicts import fastest, safest, verdicts


def _run(policy: str, ms: float, distance: float | None, skipped: int = 0) -> PolicyRun:
    return PolicyRun(policy, step_times=[ms / 1e3] * 3, losses=[1.0, 0.9], loss_scales=[1.0, 1.0],
                     skipped_steps=skipped, loss_distance=distance)  # fmt: skip


def _report(**kw: object) -> AdviceReport:
    runs = [_run("O0", 10, 0.0), _run("O2-bf16", 6, 0.01), PolicyRun("O1", status="failed: X: y")]
    fields: dict[str, object] = dict(
        backend="numpy", device="cpu", recommended="O2-bf16", reason="fastest", runs=runs,
        memory_measure="RSS", steps=2, tolerance=0.05, threshold=0.01,
        recommended_toml=mixprec.get_policy("O2-bf16").to_toml(),
    )  # fmt: skip
    fields.update(kw)
    return AdviceReport(**fields)  # type: ignore[arg-type]


def test_default_candidates_are_the_presets_the_device_computes_in() -> None:
    caps = mixprec.Capabilities(
        "x", "1", (mixprec.DeviceCapability("cpu", ("float32", "bfloat16")),)
    )
    assert candidate_policies(caps, "cpu") == ["O0", "O1-bf16", "O2-bf16", "O3-bf16"]
    full = mixprec.Capabilities(
        "x", "1", (mixprec.DeviceCapability("cuda:0", ("float32", "bfloat16", "float16")),)
    )
    assert candidate_policies(full, "cuda") == [
        "O0",
        "O1",
        "O2",
        "O3",
        "O1-bf16",
        "O2-bf16",
        "O3-bf16",
    ]


def test_loss_distance_is_relative_and_infinite_for_a_non_finite_loss() -> None:
    assert loss_distance([1.0, 2.2], [1.0, 2.0]) == pytest.approx(0.05)
    assert loss_distance([1.0, math.nan], [1.0, 2.0]) == math.inf
    assert loss_distance([], [1.0]) == math.inf


def test_a_class_rule_only_when_every_module_of_the_class_is_over_threshold() -> None:
    rows = [ModuleSensitivity("a.0", "Norm", 1, 1, 0), ModuleSensitivity("b.0", "Norm", 1, 0.5, 0)]
    assert propose_rule(rows[0], rows, 0.01) == "class:Norm=float32"
    rows[1].added_error = 0.001
    assert propose_rule(rows[0], rows, 0.01) == "path:a.0=float32"


def test_recommend_takes_low_precision_even_where_float32_is_faster_and_ranks_speed_apart() -> None:
    # float16 on a CPU: slower than float32, but within tolerance, so it is the advice
    runs = [_run("O0", 5, 0.0), _run("O1", 20, 0.004), _run("O1-bf16", 9, 0.03),
            _run("O2", 7, 0.5), _run("O3", 1, math.inf, skipped=2),
            PolicyRun("O2-bf16", status="failed: X: y")]  # fmt: skip
    judged = (0.05, 0.2, 10)
    policy, reason = recommend(runs, *judged)
    assert policy == "O1-bf16" and "fastest of 2 low-precision policies" in reason
    assert "0.56x float32's speed here" in reason
    assert fastest(runs, *judged) == "O0" and safest(runs, *judged) == "O1"
    assert verdicts(runs, policy, *judged) == [
        "float32 reference; fastest here",
        "rejected: 2.22x slower than O1-bf16",
        "recommended",
        "rejected: loss distance 0.500 > tolerance 0.05",
        "rejected: its loss went inf/NaN (loss distance inf > tolerance 0.05)",
        "rejected: it failed: X: y",
    ]
    skipping = [_run("O0", 5, 0.0), _run("O2", 4, 0.01, skipped=3)]
    assert recommend(skipping, *judged)[0] == "O0"
    assert verdicts(skipping, "O0", *judged) == [
        "recommended",
        "rejected: skipped 3 of 10 steps after the warm-up (> 20%)",
    ]


def test_recommend_takes_the_fastest_run_within_tolerance_and_few_skips() -> None:
    runs = [_run("O0", 10, 0.0), _run("O1", 2, 0.3), _run("O2", 3, 0.01, skipped=3),
            _run("O2-bf16", 6, 0.02), PolicyRun("O3", status="failed: boom")]  # fmt: skip
    policy, reason = recommend(runs, tolerance=0.05, max_skip_fraction=0.2, steps=10)
    assert policy == "O2-bf16"  # O1 drifted, O2 skipped 20%+ of its steps
    assert "1.67x float32's speed" in reason
    assert recommend(runs[:1] + runs[4:], 0.05, 0.2, 10)[0] == "O0"
    assert recommend([runs[1]], 0.05, 0.2, 10)[0] == "O0"  # nothing healthy: float32


def test_report_json_table_and_toml(tmp_path: Path) -> None:
    head = ModuleSensitivity("head", "Linear", math.inf, math.inf, 0.1)
    report = _report(sensitivity_policy="O2-bf16", sensitivity=[head], notes=["a note"])
    data = json.loads(report.to_json())
    assert data["sensitivity"][0]["added_error"] == "inf"  # JSON has no inf
    assert data["runs"][2]["status"] == "failed: X: y"
    table = report.table()
    assert "failed: X: y" in table and "recommended: O2-bf16  (fastest)" in table
    assert "head" in table and "inf" in table and "note: a note" in table
    assert mixprec.load_toml(report.write_toml(tmp_path / "p.toml")) == mixprec.get_policy(
        "O2-bf16"
    )
    with pytest.raises(mixprec.MixprecError, match="no run of policy 'O3'"):
        report.run("O3")


def test_the_report_modules_import_no_framework_and_no_matplotlib() -> None:
    code = (
        "import sys, mixprec.advisor.report, mixprec.advisor.run, mixprec.advisor.command\n"
        "import mixprec.cli\n"
        "bad = [m for m in ('torch', 'mxnet', 'numpy', 'matplotlib', 'tqdm') if m in sys.modules]\n"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_widely_varying_step_times_are_flagged() -> None:
    steady, busy = _run("O0", 10, 0.0), _run("O2-bf16", 6, 0.01)
    busy.step_times = [0.01, 0.05, 0.012]
    notes = timing_notes([steady, busy])
    assert len(notes) == 1 and notes[0].startswith("O2-bf16: step times vary 5x")


def test_fp8_presets_are_candidates_where_the_device_lists_their_recipe() -> None:
    cap = mixprec.DeviceCapability("cpu", ("float32", "bfloat16"), fp8_recipes=("tensorwise",))
    caps = mixprec.Capabilities("x", "1", (cap,))
    assert candidate_policies(caps, "cpu") == [
        "O0", "O1-bf16", "O2-bf16", "O3-bf16", "O1-fp8", "O2-fp8"
    ]  # fmt: skip
