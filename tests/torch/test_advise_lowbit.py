"""The advisor's low-bit optimizer-state candidates (issue 35, item 5): the twins it trains
(``O0,state=int8`` and the recommendation's), the state bytes per parameter of every run
in the table and the JSON, and the verdicts: a low-bit state run is recommended only when its
loss stays within the tolerance of its float32-state twin's, and its line says what it saves.

The judgement is checked on hand-made rows (no training); the runs use the smallest models
and step counts of ``test_advise.py``.
"""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import mixprec  # noqa: E402
import mixprec.torch as mpt  # noqa: E402
from mixprec.advisor.report import PolicyRun, state_saving  # noqa: E402
from mixprec.advisor.run import DEFAULT_STATES, low_bit_variant  # noqa: E402
from mixprec.advisor.verdicts import (  # noqa: E402
    check_states,
    recommend,
    safest,
    smallest_state,
    verdicts,
)
from mixprec.cli import main  # noqa: E402
from mixprec.kit import AdviceError  # noqa: E402

JUDGED = (0.05, 0.2, 10)


# ---------------------------------------------------------------- the judgement, by hand


def _row(
    policy: str,
    ms: float,
    distance: float,
    state: float,
    twin: str | None = None,
    apart: float | None = None,
    mib: float | None = None,
) -> PolicyRun:
    """A finished run: ``state`` bytes of optimizer state per parameter (1000 parameters)."""
    return PolicyRun(
        policy, step_times=[ms / 1e3] * 3, losses=[1.0, 0.9], loss_scales=[1.0, 1.0],
        loss_distance=distance, state_bytes=int(state * 1000), parameters=1000,
        state_twin=twin, twin_distance=apart,
        peak_memory=None if mib is None else int(mib * 2**20),
    )  # fmt: skip


def test_speed_never_recommends_a_low_bit_twin_slower_than_float32() -> None:
    """Issue 36 holds with the twins: on a CPU without fast bfloat16, float32 stays."""
    runs = [_row("O0", 5, 0.0, 8.0), _row("O2-bf16", 20, 0.01, 8.0),
            _row("O0,state=int8", 7, 0.002, 2.0, "O0", 0.002)]  # fmt: skip
    policy, reason = recommend(runs, *JUDGED)
    assert policy == "O0"
    assert "the fastest, O2-bf16," in reason  # a compute precision, not the twin of float32
    lines = verdicts(runs, policy, *JUDGED)
    assert lines[2] == "rejected: 1.40x slower than O0"  # its saving: a line of its own
    assert state_saving(runs[2], runs[0]) == (
        "state 2.00 B/param, 4.00x less than O0's 8.00 (5.9 KiB saved)"
    )
    # a tie on time goes to the optimizer's own state: quantizing costs time, saves none
    tied = [_row("O0", 5, 0.0, 8.0), _row("O0,state=int8", 4.9, 0.0, 2.0, "O0", 0.0)]
    assert recommend(tied, *JUDGED)[0] == "O0"
    assert verdicts(tied, "O0", *JUDGED)[1].startswith(
        "rejected: as fast as O0 within 10% (a tie); its low-bit state saves no time"
    )


def test_a_twin_within_tolerance_of_float32_but_not_of_its_twin_is_rejected() -> None:
    runs = [_row("O0", 10, 0.0, 8.0, mib=100), _row("O2-bf16", 6, 0.01, 8.0, mib=90),
            _row("O2-bf16,state=int8", 6, 0.04, 2.0, "O2-bf16", 0.06, mib=60)]  # fmt: skip
    for objective in ("speed", "memory"):
        policy, _ = recommend(runs, *JUDGED, objective)
        assert policy == "O2-bf16", objective
    line = verdicts(runs, "O2-bf16", *JUDGED, "memory")[2]
    assert line == (
        "rejected: loss distance 0.060 from its float32-state twin O2-bf16 > tolerance 0.05"
    )
    assert smallest_state(runs, *JUDGED) == "O0"  # equal state: the closest to float32
    # its twin failed: nothing to judge it against, so never recommended
    runs[1] = PolicyRun("O2-bf16", status="failed: X: y")
    runs[2].twin_distance = None
    assert verdicts(runs, "O0", *JUDGED)[2].startswith(
        "rejected: its float32-state twin O2-bf16 did not train to the end"
    )


def test_memory_recommends_the_twin_within_tolerance_of_its_twin_and_says_the_saving() -> None:
    # peak memory tied within 10% (the state is a small part of it): the least state wins
    runs = [_row("O0", 10, 0.0, 8.0, mib=100), _row("O2-bf16", 6, 0.01, 8.0, mib=80),
            _row("O2-bf16,state=int8", 7, 0.012, 2.0, "O2-bf16", 0.004, mib=78),
            _row("O0,state=int8", 11, 0.003, 2.0, "O0", 0.003, mib=95)]  # fmt: skip
    policy, reason = recommend(runs, *JUDGED, "memory")
    assert policy == "O2-bf16,state=int8"
    assert reason.endswith(
        "its optimizer state in low bits: state 2.00 B/param, 4.00x less than O2-bf16's 8.00 "
        "(5.9 KiB saved), loss distance 0.004 from O2-bf16's"
    )
    lines = verdicts(runs, policy, *JUDGED, "memory")
    assert lines[2] == "recommended"  # the reason above says the saving
    assert lines[1].startswith(
        "rejected: 80.0 MiB, as small as O2-bf16,state=int8's 78.0 MiB within 10% (a tie); "
        "O2-bf16,state=int8 keeps less optimizer state"
    )
    assert smallest_state(runs, *JUDGED) == "O0,state=int8"  # as small, closer
    # speed on the same rows: the fastest, with the optimizer's own state
    assert recommend(runs, *JUDGED, "speed")[0] == "O2-bf16"


def test_numerics_ranks_compute_precisions_and_leaves_the_twins_out() -> None:
    runs = [_row("O0", 10, 0.0, 8.0), _row("O2-bf16", 6, 0.01, 8.0),
            _row("O0,state=int8", 11, 0.001, 2.0, "O0", 0.001)]  # fmt: skip
    policy, _ = recommend(runs, *JUDGED, "numerics")
    assert policy == "O2-bf16" and safest(runs, *JUDGED) == "O2-bf16"
    assert verdicts(runs, policy, *JUDGED, "numerics")[2] == (
        "rejected: objective numerics ranks compute precisions, not the optimizer's state"
    )
    only = [runs[0], runs[2]]  # no low-precision compute qualifies: float32, not its twin
    assert recommend(only, *JUDGED, "numerics")[0] == "O0"


def test_a_twin_that_saves_nothing_is_never_recommended() -> None:
    """Every parameter under the format's min_size: the state stays float32."""
    runs = [_row("O0", 10, 0.0, 8.0, mib=50),
            _row("O0,state=int8", 10, 0.0, 8.0, "O0", 0.0, mib=40)]  # fmt: skip
    assert recommend(runs, *JUDGED, "memory")[0] == "O0"
    line = verdicts(runs, "O0", *JUDGED, "memory")[1]
    assert line == "rejected: its state is no smaller than O0's"
    saving = state_saving(runs[1], runs[0])
    assert saving.startswith("state 8.00 B/param, ")
    assert "no parameter is quantized: each is under the format's min_size, 4096" in saving


def test_states_are_checked_and_the_twins_named_canonically() -> None:
    assert check_states(("int8", "int8", "int4(min_size=0)")) == ["int8", "int4(min_size=0)"]
    assert check_states("none") == check_states(()) == check_states(None) == []
    assert check_states("fp8") == ["fp8"]
    with pytest.raises(AdviceError, match="names no low-bit state format"):
        check_states(["bfloat16"])
    with pytest.raises(mixprec.PolicyError):
        check_states(["int8(block=7)"])
    assert low_bit_variant("O0", "int8") == "O0,state=int8"
    assert low_bit_variant("base=O2,path:2=float32", "int4") == (
        "base=O2,state=int4,path:2=float32"
    )
    assert low_bit_variant("O3-bf16", "int8") is None  # bf16 weights, no masters
    assert low_bit_variant("O0,state=int8", "int4") is None  # a state of its own
    # the backend's default is the advisor's
    assert inspect.signature(mpt.advise).parameters["states"].default == DEFAULT_STATES


# ---------------------------------------------------------------- runs


class Wide(nn.Module):
    """A hidden layer of 64 x 64 = 4096 weights: int8's default min_size, so quantized."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.hidden, self.head = nn.Linear(8, 64), nn.Linear(64, 64), nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(torch.relu(self.inp(x)))))


def tiny_batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [
        (torch.randn(4, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen))
        for _ in range(n)
    ]


def adam(params: object) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)  # type: ignore[arg-type]


def _adam_bytes(model: nn.Module, fmt: str | None) -> float:
    """Adam's state per parameter as the policy keeps it: two moments per element, in
    float32 or as codes and one float32 absmax per block (tensors under 4096 elements in
    float32)."""
    total = params = 0
    for p in model.parameters():
        params += p.numel()
        if fmt is None or p.numel() < 4096:
            total += 2 * 4 * p.numel()
        else:
            block, codes = (256, p.numel()) if fmt == "int8" else (128, (p.numel() + 1) // 2)
            total += 2 * (codes + 4 * math.ceil(p.numel() / block))
    return total / params


@pytest.fixture(scope="module")
def wide_report() -> mixprec.advisor.report.AdviceReport:
    return mpt.advise(Wide(), adam, tiny_batches(), nn.functional.cross_entropy, ["O2-bf16"], 4,
                      progress=False, states=("int8", "int4"))  # fmt: skip


def test_the_twins_of_float32_and_of_the_recommendation_are_trained(wide_report) -> None:  # type: ignore[no-untyped-def]
    report = wide_report
    assert [r.policy for r in report.runs][:2] == ["O0", "O2-bf16"]
    twins = [r for r in report.runs if r.state_twin is not None]
    bases = list(dict.fromkeys(r.state_twin for r in twins))
    assert bases[0] == "O0" and len(bases) in (1, 2)  # float32's, and a low-precision one's
    assert [r.policy for r in twins] == [
        low_bit_variant(base, fmt) for fmt in ("int8", "int4") for base in bases
    ]
    tuned = 0 if report.tuned_policy is None else 1
    assert len(report.runs) == 2 + tuned + len(twins)
    for twin in twins:
        assert twin.ok, twin.status
        assert twin.twin_distance is not None and twin.twin_distance <= report.tolerance
        assert twin.loss_distance is not None and twin.loss_distance <= report.tolerance
        fmt = "int8" if "int8" in twin.policy else "int4"
        assert twin.state_bytes_per_param == pytest.approx(_adam_bytes(Wide(), fmt))
        assert f"x less than {twin.state_twin}'s 8.00" in str(report)
    assert report.states == ["int8", "int4"]
    # the speed objective keeps issue 36's promise: never slower than float32 here
    chosen, o0 = report.run(report.recommended), report.run("O0")
    assert chosen.median_time is not None and o0.median_time is not None
    assert chosen.policy == "O0" or min(chosen.step_times) <= o0.median_time * 1.1


def test_every_run_reports_its_state_per_parameter_in_the_table_and_the_json(wide_report) -> None:  # type: ignore[no-untyped-def]
    report = wide_report
    for policy in ("O0", "O2-bf16"):  # Adam: two float32 moments, the masters not counted
        assert report.run(policy).state_bytes_per_param == 8.0
    table = report.table()
    assert "state B/param" in table.splitlines()[0]
    assert "state: optimizer state between steps per parameter" in table
    assert f"low-bit state: O0,state=int8: state {_adam_bytes(Wide(), 'int8'):.2f}" in table
    assert "smallest state: " in table and "float32's 8.00 B/param" in table
    assert report.smallest_state is not None and "int4" in report.smallest_state
    data = json.loads(report.to_json())
    for run, row in zip(report.runs, data["runs"], strict=True):
        assert row["state_bytes_per_param"] == run.state_bytes_per_param
        assert row["state_bytes"] == run.state_bytes and row["parameters"] == 4996
        assert row["state_twin"] == run.state_twin
    assert data["states"] == ["int8", "int4"] and data["smallest_state"] == report.smallest_state


def test_a_candidate_named_with_a_low_bit_state_gets_its_twin_trained() -> None:
    report = mpt.advise(Wide(), adam, tiny_batches(2), nn.functional.cross_entropy,
                        ["O1-bf16,state=int8"], 2, progress=False, states=())  # fmt: skip
    assert [r.policy for r in report.runs] == ["O0", "O1-bf16", "O1-bf16,state=int8"]
    run = report.run("O1-bf16,state=int8")
    assert run.state_twin == "O1-bf16" and run.twin_distance is not None
    assert report.sensitivity_policy == "O1-bf16"  # a low-bit state changes no module
    assert report.states == []


def test_an_optimizer_without_low_bit_state_gets_no_twin_and_a_note() -> None:
    def rmsprop(params: object) -> torch.optim.Optimizer:
        return torch.optim.RMSprop(params, lr=1e-3)  # type: ignore[arg-type]

    report = mpt.advise(Wide(), rmsprop, tiny_batches(2), nn.functional.cross_entropy, [], 2,
                        progress=False)  # fmt: skip
    assert [r.policy for r in report.runs] == ["O0"]
    assert report.run("O0").state_bytes_per_param == 4.0  # RMSprop's square average
    (note,) = [n for n in report.notes if n.startswith("state=int8: not offered")]
    assert "the torch backend refused O0,state=int8 (WrapError: " in note
    assert "RMSprop" in note


FACTORY = """\
import torch
from torch import nn


def factory():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 2))
    batches = [(torch.randn(4, 8), torch.randint(0, 2, (4,))) for _ in range(2)]
    return model, lambda p: torch.optim.Adam(p), batches, nn.functional.cross_entropy


def exploding():
    raise SystemExit("the factory ran: training would follow")
"""


@pytest.mark.slow
def test_the_command_takes_states(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "lowbit_advice_case.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "advice"
    code = main(["advise", "lowbit_advice_case:factory", "--candidates", "O0", "--steps", "2",
                 "--states", "int8,int4(min_size=0)", "--out", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0
    assert "O0,state=int8 " in printed and "O0,state=int4(min_size=0) " in printed
    data = json.loads((out / "report.json").read_text())
    assert data["states"] == ["int8", "int4(min_size=0)"]
    assert all(isinstance(r["state_bytes_per_param"], float) for r in data["runs"])
    assert "state B/param" in (out / "report.txt").read_text()
    code = main(["advise", "lowbit_advice_case:factory", "--candidates", "O0", "--steps", "2",
                 "--states", "none", "--out", str(out)])  # fmt: skip
    assert code == 0 and "state=int8" not in capsys.readouterr().out


def test_the_command_refuses_a_bad_state_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "lowbit_advice_case.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    for states, said in (("int9", "'int9' names no low-bit state format"),
                         ("int8(block=7)", "block")):  # fmt: skip
        assert main(["advise", "lowbit_advice_case:exploding", "--states", states]) == 2
        err = capsys.readouterr().err
        assert said in err and "factory ran" not in err, err
