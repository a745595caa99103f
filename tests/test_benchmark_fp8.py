"""Smoke test of ``python -m benchmarks.fp8`` at its smallest: the functions its documented
figures come from run and show the effects the page reports."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:  # the benchmarks package lives at the repository root
    sys.path.insert(0, ROOT)

from benchmarks import fp8  # noqa: E402

#: Seconds each under load; tests/torch/test_fp8_training.py and test_fp8_stats.py check the
#: same effects in the default run.
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _one_thread() -> object:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_per_tensor_recipes_save_fp8_operands_for_the_backward() -> None:
    saved = {
        policy: fp8.saved_bytes(policy) for policy in ("O1-bf16", "O1-fp8", "O1-fp8,fp8=rowwise")
    }
    assert saved["O1-fp8"] < saved["O1-bf16"] < saved["O1-fp8,fp8=rowwise"]


def test_the_planted_outlier_row_hurts_tensorwise_and_not_rowwise() -> None:
    bf16 = fp8.teacher_student("O1-bf16", 0, quick=True, outlier=True)
    tensorwise = fp8.teacher_student("O1-fp8", 0, quick=True, outlier=True)
    rowwise = fp8.teacher_student("O1-fp8,fp8=rowwise", 0, quick=True, outlier=True)
    assert tensorwise > 5 * bf16 and rowwise < 1.5 * bf16
