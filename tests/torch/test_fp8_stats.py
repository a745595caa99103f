"""FP8 what-if statistics: one run tells which layers are fragile under which recipe.

A planted outlier row in a layer's weight (a dead unit whose weights are 2**20 times the
others) makes per-tensor scaling flush the rest of that weight to zero; the statistics say
so for tensorwise and delayed and not for rowwise and mxfp8, and short real training runs
agree: the per-tensor recipes train badly, the others about as well as bfloat16, and the
module rule the statistics propose fixes tensorwise.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from _fp8_tasks import fit, one_thread, teacher  # noqa: E402, F401
from torch import nn  # noqa: E402

import mixprec  # noqa: E402
import mixprec.torch as mpt  # noqa: E402
from mixprec.errors import PolicyError, WrapError  # noqa: E402
from mixprec.kit import FP8Statistics  # noqa: E402


def _student(outlier: bool) -> nn.Module:
    torch.manual_seed(1)
    student = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    if outlier:
        with torch.no_grad():
            student[0].weight[0] *= 2.0**20
            student[0].bias[0] = -1e9  # a dead unit: no gradient ever shrinks its row
    return student


def _run(policy: str, steps: int, *, outlier: bool = True, stats_steps: int = 0) -> Any:
    """Train the student on a teacher; the mean loss of the last 10 steps, and the
    statistics of the first ``stats_steps`` steps."""
    gen = torch.Generator().manual_seed(0)
    target = teacher()
    student = _student(outlier)
    optimizer = torch.optim.Adam(student.parameters(), lr=1e-2)
    student, optimizer = mpt.wrap(student, optimizer, policy=policy)
    losses: list[float] = []
    with mpt.fp8_statistics(student) as stats:
        fit(student, optimizer, target, gen, stats_steps, losses)
    fit(student, optimizer, target, gen, steps - stats_steps, losses)
    return sum(losses[-10:]) / 10, stats, losses


def test_a_planted_outlier_row_shows_in_the_statistics_and_in_real_runs() -> None:
    _, stats, _ = _run("O1-bf16", steps=3, stats_steps=3)
    assert stats.layers == ["0", "2"]
    assert stats.fragile("tensorwise") == ["0"] and stats.fragile("delayed") == ["0"]
    assert stats.fragile("rowwise") == [] and stats.fragile("mxfp8") == []
    weight = {r["recipe"]: r for r in stats.rows() if (r["layer"], r["tensor"]) == ("0", "weight")}
    assert weight["tensorwise"]["underflow"] > 0.9 > 0.0 == weight["rowwise"]["underflow"]
    assert stats.best_recipe("0") in ("rowwise", "mxfp8")
    assert stats.rules("tensorwise") == ["path:0=bfloat16"]
    assert "!" in stats.table() and "best recipe for 0" in stats.table()
    # short real runs rank the recipes the same way
    bf16 = _run("O1-bf16", steps=60)[0]
    per_tensor = [_run(f"O1-fp8,fp8={r}", steps=60)[0] for r in ("tensorwise", "delayed")]
    per_block = [_run(f"O1-fp8,fp8={r}", steps=60)[0] for r in ("rowwise", "mxfp8")]
    assert min(per_tensor) > 2 * max(per_block)
    assert max(per_block) < 1.3 * bf16
    # and the rule the statistics propose fixes tensorwise
    fixed = mixprec.get_policy("O1-fp8").with_module("0", "bfloat16", match="path")
    assert _run(str(fixed), steps=60)[0] < 1.3 * bf16


def test_without_the_outlier_no_layer_is_fragile() -> None:
    _, stats, _ = _run("O1-fp8", steps=2, outlier=False, stats_steps=2)
    assert all(stats.fragile(recipe) == [] for recipe in stats.recipes)


def test_watching_changes_no_number() -> None:
    watched = _run("O1-fp8,fp8=delayed", steps=4, stats_steps=4)[2]
    plain = _run("O1-fp8,fp8=delayed", steps=4)[2]
    assert watched == plain


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(WrapError, match=r"nn\.Module"):
        with mpt.fp8_statistics("model"):  # type: ignore[arg-type]
            pass
    with pytest.raises(WrapError, match=r"no nn\.Linear"):
        with mpt.fp8_statistics(nn.Sequential(nn.ReLU())):
            pass
    with pytest.raises(PolicyError, match="tensorwise"):
        with mpt.fp8_statistics(_student(False), recipes=["fp4"]):
            pass
    model = _student(False)
    with mpt.fp8_statistics(model, recipes=["rowwise"]) as stats:
        model(torch.randn(2, 16))  # inference: no output gradient
    assert isinstance(stats, FP8Statistics) and stats.recipes == ("rowwise",)
    assert {r["tensor"] for r in stats.rows()} == {"input", "weight"}
    assert not model[0]._forward_hooks  # the hooks are gone


def test_the_advisor_keeps_the_fragile_layer_in_bfloat16() -> None:
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randn(32, 16, generator=gen), torch.randn(32, 4, generator=gen))]
    report = mpt.advise(
        _student(True),
        lambda p: torch.optim.Adam(p, lr=1e-3),
        batches,
        F.mse_loss,
        ["O1-fp8"],
        4,
        progress=False,
    )
    assert report.sensitivity_policy == "O1-fp8"
    # output errors blame the ReLU after the layer (the outlier unit dominates the layer's
    # output norm); the per-row FP8 statistics name the layer, and no float32 rule undoes
    # FP8 on the healthy layer "2"
    assert report.sensitivity[0].module == "1"
    assert report.rules == ["path:0=bfloat16"]
    tuned = mixprec.get_policy(report.tuned_policy)
    assert tuned.fp8_for("0", "Linear") is None and tuned.fp8_for("2", "Linear") is not None
