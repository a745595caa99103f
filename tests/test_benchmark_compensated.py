"""Smoke test of case 9 (benchmarks/compensated.py) with tiny step counts: the functions the
documented figures come from run, record what they say, and show the effect the case is for."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:  # the benchmarks package lives at the repository root
    sys.path.insert(0, ROOT)

from benchmarks import compensated, compensated_plot  # noqa: E402
from benchmarks.runner import Options  # noqa: E402


def test_kahan_keeps_the_small_updates_that_plain_bf16_weights_round_away() -> None:
    curve: list[float] = []
    plain = compensated.train_torch("O3-bf16", 0, 150)
    kahan = compensated.train_torch("O3-bf16-kahan", 0, 150, curve)
    fp32 = compensated.train_torch("fp32", 0, 150)
    assert len(curve) == 150 // compensated.CURVE_EVERY
    assert curve[-1] == pytest.approx(kahan)
    assert kahan == pytest.approx(fp32, rel=0.02)
    assert plain > 1.1 * kahan


def test_bfloat16_optimizer_state_keeps_kahans_accuracy() -> None:
    fp32 = compensated.train_torch("fp32", 0, 150)
    kahan_state = compensated.train_torch("O3-bf16-kahan,state=bfloat16", 0, 150)
    assert kahan_state == pytest.approx(fp32, rel=0.05)


def test_quick_run_reports_every_policy_with_its_metric() -> None:
    result = compensated.run_numpy(Options(quick=True, seeds=2))
    by_preset = {m.contender: m for m in result.measurements}
    assert tuple(by_preset) == compensated.NUMPY_PRESETS
    for m in by_preset.values():
        assert m.error is None, m.error
        assert m.metric == "test cross-entropy ×1e3"
        assert len(m.samples) == 2 and all(math.isfinite(s) for s in m.samples)
    assert result.lines == ["numpy: 2 seed(s) × 100 steps"]


def test_loss_curve_plot_is_a_png(tmp_path: Path) -> None:
    out = compensated_plot.plot({"fp32": [0.5, 0.2], "O3-bf16": [0.6, 0.4]}, tmp_path / "c.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_numpy_digits_group_trains_every_preset_and_rounds_the_momentum() -> None:
    result = compensated.run_digits_numpy(Options(quick=True, seeds=1))
    by_preset = {m.contender: m for m in result.measurements}
    assert tuple(by_preset) == compensated.NUMPY_DIGITS_PRESETS
    for m in by_preset.values():
        assert m.error is None, m.error
        assert m.metric == "test accuracy"
        # one epoch of SGD with momentum already classifies digits well above chance (10 %)
        assert m.samples[0] > 70, (m.contender, m.samples)
    assert result.lines == ["digits numpy: 1 seed(s) × 1 epochs"]


def test_compensation_passes_times_every_form(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import compensation_passes

    monkeypatch.setattr(compensation_passes, "WIDTH", 48)
    found = compensation_passes.measure(repeat=2, warmup=1)
    names = {m.contender for m in found}
    assert "O2-bf16" in names
    for policy in compensation_passes.POLICIES:
        for form in compensation_passes.FORMS:
            assert f"{policy}, {form}" in names
    for m in found:
        assert m.ok, (m.contender, m.error)
        assert m.metric == compensation_passes.METRIC and 0 < m.samples[0] < 1000
