"""The MLP trains on real data (scikit-learn's digits) under O2 float16 as well as in float32."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

pytest.importorskip("sklearn", reason="the digits example needs scikit-learn (extra 'test')")


def _example() -> ModuleType:
    path = Path(__file__).parents[1] / "examples" / "train_digits.py"
    spec = importlib.util.spec_from_file_location("train_digits", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_o2_float16_matches_float32_and_skips_an_injected_overflow() -> None:
    example = _example()
    fp32 = example.train("O0")
    fp16 = example.train("O2", inject_overflow_at=7)
    assert fp32.accuracy > 0.9
    assert abs(fp16.accuracy - fp32.accuracy) <= 0.01, (fp16.accuracy, fp32.accuracy)
    # the injected inf skipped exactly one step and halved the dynamic scale (2**16 -> 2**15)
    assert fp16.skipped_steps == 1 and fp32.skipped_steps == 0
    assert fp16.loss_scale == 2.0**15
    trainer = fp16.trainer
    assert {p.data.dtype for p, _ in trainer.masters.pairs} == {np.dtype(np.float16)}
    assert {m.data.dtype for m in trainer.masters.masters()} == {np.dtype(np.float32)}
