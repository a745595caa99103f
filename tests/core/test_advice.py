"""The advisor's framework-neutral parts: candidates, loss distance, rules, recommendation
and the report's formats (no framework imported)."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import mixprec
from mixprec.advisor.report import AdviceReport, ModuleSensitivity, PolicyRun
from mixprec.advisor.run import (
    candidate_policies,
    cautioned,
    loss_distance,
    propose_rule,
    recommend,
    run_advice,
    timing_notes,
)
from mixprec.advisor.verdicts import fastest, safest, verdicts
from mixprec.errors import AdviceError


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


def test_speed_never_recommends_a_policy_slower_than_float32_and_ranks_numerics_apart() -> None:
    # float16 on a CPU: slower than float32 though within tolerance: speed keeps float32
    runs = [_run("O0", 5, 0.0), _run("O1", 20, 0.004), _run("O1-bf16", 9, 0.03),
            _run("O2", 7, 0.5), _run("O3", 1, math.inf, skipped=2),
            PolicyRun("O2-bf16", status="failed: X: y")]  # fmt: skip
    judged = (0.05, 0.2, 10)
    policy, reason = recommend(runs, *judged)
    assert policy == "O0" and reason.startswith("objective speed: no low-precision policy")
    assert "the fastest, O1-bf16, runs at 0.56x float32's speed" in reason
    assert fastest(runs, *judged) == "O0" and safest(runs, *judged) == "O1"
    assert verdicts(runs, policy, *judged) == [
        "recommended",
        "rejected: 4.00x slower than O0",
        "rejected: 1.80x slower than O0",
        "rejected: loss distance 0.500 > tolerance 0.05",
        "rejected: its loss went inf/NaN (loss distance inf > tolerance 0.05)",
        "rejected: it failed: X: y",
    ]
    # the portable answer, when asked for: the low-precision policy closest to float32
    policy, reason = recommend(runs, *judged, "numerics")
    assert policy == "O1" and reason.startswith("objective numerics:")
    assert verdicts(runs, policy, *judged, "numerics")[:3] == [
        "float32 reference; fastest here",
        "recommended",
        "rejected: loss distance 0.030, O1's 0.004",
    ]
    skipping = [_run("O0", 5, 0.0), _run("O2", 4, 0.01, skipped=3)]
    assert recommend(skipping, *judged, "numerics")[0] == "O0"
    assert verdicts(skipping, "O0", *judged) == [
        "recommended",
        "rejected: skipped 3 of 10 steps after the warm-up (> 20%)",
    ]


def test_memory_objective_takes_the_smallest_peak_memory() -> None:
    runs = [_run("O0", 5, 0.0), _run("O2-bf16", 9, 0.01), _run("O3-bf16-kahan", 8, 0.02)]
    for run, mib in zip(runs, (100, 70, 50), strict=True):
        run.peak_memory = mib * 2**20
    policy, reason = recommend(runs, 0.05, 0.2, 10, "memory")
    assert policy == "O3-bf16-kahan" and "50.0 MiB" in reason
    assert verdicts(runs, policy, 0.05, 0.2, 10, "memory")[1] == (
        "rejected: 70.0 MiB, O3-bf16-kahan 50.0 MiB"
    )
    with pytest.raises(AdviceError, match="objective must be one of 'speed'"):
        recommend(runs, 0.05, 0.2, 10, "fast")


def test_ties_within_the_noise_go_by_the_stated_rule_never_to_a_warned_preset() -> None:
    """Identical runs, different timing noise: the same recommendation every time."""
    rng = random.Random(0)
    warned = cautioned(["O0", "O1-bf16", "O2-bf16", "O3-bf16"])
    assert warned == ["O3-bf16"]  # bfloat16 weights, no masters: the home page's caution
    answers = set()
    for _ in range(200):
        noise = [rng.uniform(0.98, 1.02) for _ in range(4)]  # a quiet machine
        runs = [_run("O0", 10 * noise[0], 0.0), _run("O3-bf16", 5.0 * noise[1], 0.0),
                _run("O2-bf16", 5.1 * noise[2], 0.002),
                _run("O1-bf16", 5.2 * noise[3], 0.001)]  # fmt: skip
        answers.add(recommend(runs, 0.05, 0.2, 10, "speed", warned)[0])
        answers.add(recommend(runs, 0.05, 0.2, 10, "numerics", warned)[0] + " (numerics)")
    # O3-bf16 is as close to float32 here and often fastest: a tie never goes to it
    assert answers == {"O1-bf16", "O1-bf16 (numerics)"}
    runs = [_run("O0", 10, 0.0), _run("O3-bf16", 5.0, 0.0), _run("O1-bf16", 5.2, 0.001)]
    assert verdicts(runs, "O1-bf16", 0.05, 0.2, 10, "speed", warned)[1] == (
        "rejected: as fast as O1-bf16 within 10% (a tie); the docs warn about it; fastest here"
    )
    # a busy machine (the demo CNN under load): float32's median looks slower, but its
    # fastest step is within the band of O2-bf16's median: a tie, which float32 wins
    busy = [_run("O0", 1430, 0.0), _run("O2-bf16", 1024, 0.015)]
    busy[0].step_times = [0.7217, 1.430, 2.6079]
    assert recommend(busy, 0.05, 0.2, 10)[0] == "O0"
    # float32 within the noise of the fastest: float32 (distance 0) wins the tie
    close = [_run("O0", 5.2, 0.0), _run("O2-bf16", 5.0, 0.01)]
    assert recommend(close, 0.05, 0.2, 10)[0] == "O0"


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


class _Trainee:
    def __init__(self, policy: str) -> None:
        self.policy, self.steps = policy, 0

    def step(self, batch: float) -> float:
        self.steps += 1
        if self.policy == "O2-bf16":  # a candidate that skips: its guard warns every step
            warnings.warn("skipped 10 steps in a row", mixprec.RepeatedSkipWarning, stacklevel=1)
        return batch / self.steps

    def loss_scale(self) -> float:
        return 1.0

    def skipped_steps(self) -> int:
        return 0

    def underflow_fraction(self) -> float | None:
        return None

    def peak_memory(self) -> int | None:
        return 1


class _Target:
    backend, device = "fake", "cpu"

    def capabilities(self) -> mixprec.Capabilities:
        return mixprec.Capabilities("x", "1", (mixprec.DeviceCapability("cpu", ("float32",)),))

    def memory_measure(self) -> str:
        return "bytes"

    def start(self, policy: str) -> _Trainee:
        return _Trainee(policy)

    def sensitivity(self, policy: str, batch: float) -> list[ModuleSensitivity]:
        return []


def test_candidates_warnings_go_into_the_notes_and_piped_progress_prints_a_line_each(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning that reached the caller would raise here
        report = run_advice(_Target(), [1.0, 2.0], candidates=["O1-bf16", "O2-bf16"], steps=4)
    err = capsys.readouterr().err  # pytest's stderr is not a terminal: the piped form
    assert "advise fake: 3 policies, 4 steps each, objective speed: O0, O1-bf16, O2-bf16" in err
    for n, policy in enumerate(("O0", "O1-bf16", "O2-bf16"), 1):
        assert f"advise fake: [{n}/3] {policy}: " in err
    assert "skipped 10 steps" not in err
    assert "O2-bf16: RepeatedSkipWarning: skipped 10 steps in a row (4 times)" in report.notes
    assert "no module could be measured" in report.table()
    assert report.objective == "speed" and "objective: speed" in report.table()
    run_advice(_Target(), [1.0], candidates=["O1-bf16"], steps=2, progress=False)
    assert capsys.readouterr().err == ""


def test_time_vs_distance_labels_never_overlap(tmp_path: Path) -> None:
    """Runs drawn almost on top of each other (the demo CNN's bfloat16 rows): every label is
    a legend entry beside the axes, none next to a point, and no two labels' boxes meet."""
    pytest.importorskip("matplotlib")
    from mixprec.advisor.plots import time_vs_distance_figure

    runs = [_run("O0", 10, 0.0), _run("O1-bf16", 30.0, 0.004), _run("O2-bf16", 30.2, 0.0041),
            _run("O3-bf16", 30.1, 0.0042),
            _run("base=O2-bf16,path:head=float32", 30.3, 0.004)]  # fmt: skip
    for run in runs:
        run.verdict = "rejected: as fast as O1-bf16 within 10% (a tie); farther from float32"
    runs[0].verdict = "recommended"
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = time_vs_distance_figure(_report(runs=runs))
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    ax = fig.axes[0]
    assert len(ax.texts) == 0  # no annotation next to a point
    renderer = canvas.get_renderer()
    boxes = [text.get_window_extent(renderer) for text in ax.get_legend().get_texts()]
    assert len(boxes) == len(runs) + 1  # every run, and the tolerance line
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b), (a, b)
    assert all(not box.overlaps(ax.get_window_extent(renderer)) for box in boxes)
    paths = _report(runs=runs).plot(tmp_path)
    assert all(path.stat().st_size > 1000 for path in paths)
