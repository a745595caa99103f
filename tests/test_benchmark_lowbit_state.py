"""Case 13 (benchmarks/lowbit_state.py): the byte counts, the lockstep training, the page's
tables and the targets its figures are held to, on small models and few steps."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:  # the benchmarks package lives at the repository root
    sys.path.insert(0, ROOT)

import mixprec.torch as mpt  # noqa: E402
from benchmarks import lowbit_state as lb  # noqa: E402
from benchmarks.runner import Measurement, Options  # noqa: E402
from benchmarks.targets import TARGETS, evaluate, limit_text  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _step(model: Any, opt: Any) -> None:
    opt.zero_grad()
    model(torch.randn(4, 128)).float().square().mean().backward()
    opt.step()


@pytest.mark.parametrize(("policy", "bits"), [("O0,state=int8", 8), ("O0,state=int4", 4)])
def test_state_bytes_are_the_codes_the_absmax_and_the_small_tensors_in_float32(
    policy: str, bits: int
) -> None:
    # a 64 x 128 weight (8,192 elements: quantized) and a bias of 64 (float32 state)
    model = torch.nn.Linear(128, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model, opt = mpt.wrap(model, opt, policy=policy)
    _step(model, opt)
    state, weights = lb.kept_bytes(model, opt)
    block = 256 if bits == 8 else 128
    moments = 2 * (8192 * bits // 8 + 8192 // block * 4)  # codes + float32 absmax, two moments
    assert state == moments + 2 * 64 * 4 + 2 * 4  # + the bias's float32 moments + two steps
    assert weights == 8256 * 4  # O0: the float32 weights are the masters, counted once


def test_weights_and_state_of_o3_sr_int8_count_bfloat16_weights() -> None:
    model = torch.nn.Linear(128, 64, bias=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model, opt = mpt.wrap(model, opt, policy="O3-bf16-sr,state=int8")
    _step(model, opt)
    state, weights = lb.kept_bytes(model, opt)
    assert state == 2 * (8192 + 32 * 4) + 4
    # bfloat16 weights, and the working masters' 4-byte placeholder between steps
    assert weights == 8192 * 2 + 4


def test_a_tensor_subclass_counts_its_inner_tensors_and_shared_storage_once() -> None:
    class Packed(torch.Tensor):  # stands for torchao's quantized state: codes and a map
        @staticmethod
        def __new__(cls, codes: Any, qmap: Any) -> Any:
            return torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=torch.float32)

        def __init__(self, codes: Any, qmap: Any) -> None:
            self.codes, self.qmap = codes, qmap

        def __tensor_flatten__(self) -> Any:
            return ["codes", "qmap"], None

        @classmethod
        def __torch_dispatch__(
            cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            raise NotImplementedError(func)

    qmap = torch.zeros(256)
    a = Packed(torch.zeros(1000, dtype=torch.uint8), qmap)
    b = Packed(torch.zeros(10, dtype=torch.uint8), qmap)
    assert [t.numel() for t in lb.leaves(a)] == [1000, 256]
    opt = type("Opt", (), {"state": {0: {"m": a, "step": 3}, 1: {"m": b}}})()
    assert lb.storage_bytes(lb.state_tensors(opt)) == 1000 + 10 + 256 * 4


@pytest.mark.filterwarnings("ignore")  # torchao's import warns about torch's own APIs
def test_torchao_state_counts_its_codes_scales_and_map() -> None:
    subclass_8bit = pytest.importorskip("torchao.optim.subclass_8bit")
    state = subclass_8bit.OptimState8bit.zeros((64, 128))
    opt = type("Opt", (), {"state": {0: {"exp_avg": state}}})()
    # uint8 codes, a float32 scale per 256 elements, the 256-value float32 map of the tensor
    assert lb.storage_bytes(lb.state_tensors(opt)) == 8192 + 32 * 4 + 256 * 4


@pytest.mark.slow
def test_lockstep_trains_every_row_on_the_same_batches_and_drops_a_failing_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lb, "make_optimizer", _no_bnb(lb.make_optimizer))
    batches = lb.teacher_batches(0, 8)
    failed: dict[str, str] = {}
    rows = (lb.FUSED, "O0", "O0,state=int8", lb.BNB)
    runs = lb.lockstep("t", rows, lb.mlp, 1e-3, batches, 0, 3, failed)
    assert [r.row for r in runs] == [lb.FUSED, "O0", "O0,state=int8"]
    assert failed[lb.BNB].startswith(f"not installed ({lb.INSTALL}): ModuleNotFoundError")
    fused, o0, int8 = runs
    assert o0.losses == fused.losses  # O0 wraps the same fused AdamW: bit for bit
    assert int8.losses[:2] == fused.losses[:2]  # the state is first read at the second step
    assert int8.losses[-1] != fused.losses[-1]
    assert all(len(r.losses) == 8 and len(r.steps) == 5 for r in runs)


@pytest.mark.slow
def test_the_measurements_and_the_page_tables_of_a_short_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(lb, "ROWS", (lb.FUSED, "O0", "O0,state=int4", lb.BNB))
    monkeypatch.setattr(lb, "MLP_STEPS", 25)
    monkeypatch.setattr(lb, "make_optimizer", _no_bnb(lb.make_optimizer))
    result = lb.run_mlp(Options(warmup=5))
    got = {(m.contender, m.metric): m for m in result.measurements}
    assert got[("O0,state=int4", lb.RATIO)].value == pytest.approx(
        got[("O0,state=int4", lb.LOSS)].value / got[("O0", lb.LOSS)].value
    )
    assert (lb.FUSED, lb.RATIO) not in got  # a float32 row has no ratio of its own
    assert got[(lb.FUSED, lb.STATE)].value == pytest.approx(8.0, abs=1e-3)
    assert 1.0 < got[("O0,state=int4", lb.STATE)].value < 1.1
    assert len(got[("O0", lb.STEP)].samples) == 20
    assert not got[(lb.BNB, lb.LOSS)].ok
    run = {"cases": {lb.CASE_NAME: {"measurements": [m.to_dict() for m in result.measurements]}}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    # a contender that did not run at all has no row; one that failed says why
    monkeypatch.setattr(lb, "ROWS", (*lb.ROWS, "torchao AdamW8bit"))
    assert lb.main([str(path)]) == 0
    page = capsys.readouterr().out
    assert "torchao" not in page and "**digits CNN**" not in page
    assert "| `bitsandbytes AdamW8bit` | — (not installed (make bench-lowbit): " in page
    int4 = next(line for line in page.splitlines() if line.startswith("| `O0,state=int4`"))
    assert int4.split(" | ")[3:5] == ["1.08", "5.08"]  # state, weights + state (B/param)


def _no_bnb(make: Any) -> Any:
    def make_optimizer(row: str, params: Any, lr: float) -> Any:
        if row == lb.BNB:
            raise ModuleNotFoundError("No module named 'bitsandbytes'")
        return make(row, params, lr)

    return make_optimizer


def _m(contender: str, metric: str, value: float, unit: str = "") -> Measurement:
    return Measurement(lb.CASE_NAME, lb.MLP, contender, metric, unit, [value])


def test_the_targets_of_the_case() -> None:
    mine = {t.id: t for t in TARGETS if t.case == lb.CASE_NAME}
    assert set(mine) == {
        "lowbit-loss-O0-int8", "lowbit-loss-O2-bf16-int8", "lowbit-loss-O3-bf16-sr-int8",
        "lowbit-loss-O0-int4", "lowbit-loss-O0-fp8", "lowbit-bytes-int8", "lowbit-bytes-int4",
        "lowbit-bytes-o3-sr", "lowbit-step-bnb", "lowbit-step-fused",
    }  # fmt: skip
    found = [
        _m("O0", lb.LOSS, 1.0), _m("O0,state=int8", lb.LOSS, 1.03),
        _m("O0,state=int4", lb.LOSS, 1.11), _m("O0,state=fp8", lb.LOSS, 0.9),
        _m("O0,state=int8", lb.STATE, 2.05, "B/param"),
        _m("O2-bf16,state=int8", lb.STATE, 2.1, "B/param"),
        _m("O3-bf16-sr,state=int8", lb.STATE, 2.11, "B/param"),
        _m("O0,state=int8", lb.STEP, 1.3, "ms"), _m(lb.FUSED, lb.STEP, 1.0, "ms"),
        _m(lb.BNB, lb.STEP, 1.4, "ms"),
    ]  # fmt: skip
    status = {i: evaluate(t, found).status for i, t in mine.items()}
    assert status == {
        "lowbit-loss-O0-int8": "met",  # the limit is included
        "lowbit-loss-O0-int4": "missed",
        "lowbit-loss-O0-fp8": "met",  # a lower loss is no miss
        "lowbit-loss-O2-bf16-int8": "not measured",
        "lowbit-loss-O3-bf16-sr-int8": "not measured",
        "lowbit-bytes-int8": "missed",  # the worst int8 row decides
        "lowbit-bytes-int4": "not measured",
        "lowbit-bytes-o3-sr": "not measured",
        "lowbit-step-bnb": "met",
        "lowbit-step-fused": "met",
    }
    assert limit_text(mine["lowbit-bytes-int8"]) == "≤ 2.1 B/param"
    assert (
        "2.11 B/param (O3-bf16-sr,state=int8)" in evaluate(mine["lowbit-bytes-int8"], found).detail
    )
