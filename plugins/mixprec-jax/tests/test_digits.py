"""flax MLP and CNN on real data (scikit-learn's digits), trained by the example script."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("sklearn", reason="the digits example needs scikit-learn (extra 'test')")


def _example() -> ModuleType:
    path = Path(__file__).parents[1] / "examples" / "train_digits.py"
    spec = importlib.util.spec_from_file_location("jax_train_digits", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_mlp_o2_float16_matches_float32_and_skips_an_exploding_batch() -> None:
    example = _example()
    fp32 = example.train("O0", "mlp")
    fp16 = example.train("O2", "mlp", inject_overflow_at=5)
    assert fp32.accuracy > 0.9
    assert abs(fp16.accuracy - fp32.accuracy) <= 0.02, (fp16.accuracy, fp32.accuracy)
    # the exploding batch skipped exactly that step and halved the dynamic scale
    assert fp16.skips == [5] and fp16.skipped_steps == 1 and fp32.skipped_steps == 0
    assert fp16.loss_scale == 2.0**15
    assert "Dense  float16" in fp16.report and "float32 master copies" in fp16.report


def test_cnn_o2_bf16_keeps_batchnorm_float32_and_learns() -> None:
    example = _example()
    result = example.train("O2-bf16", "cnn", epochs=4, inject_overflow_at=3)
    assert result.accuracy > 0.85, result.accuracy
    assert result.skips == [3]  # bfloat16 has no loss scale, but the step is still guarded
    rows = {line.split()[0]: line.split() for line in result.report.splitlines()[2:5]}
    assert rows["BatchNorm_0"][1:4] == ["BatchNorm", "float32", "float32"]
    assert rows["Conv_0"][1:4] == ["Conv", "bfloat16", "bfloat16"]
    assert all(v.dtype.name == "float32" for v in _leaves(result.state.model_state))


def _leaves(tree: object) -> list:  # type: ignore[type-arg]
    import jax

    return jax.tree_util.tree_leaves(tree)
