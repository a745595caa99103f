"""Wrap-time lint: Adam eps underflow and loss scaling without master weights."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mixprec.errors import WrapError
from mixprec.policy.lint import adam_eps_underflows, check_adam_eps, check_scaler_without_masters


@pytest.mark.parametrize(
    ("eps", "dtype", "underflows"),
    [
        (1e-8, "float16", True),
        (1e-8, "bfloat16", False),
        (1e-8, "float32", False),
        (1e-4, "float16", False),
        (5e-8, "float16", True),  # rounds to the smallest subnormal: nonzero but imprecise
        (6e-8, "float16", False),
        (1e-8, "fp16", True),
        (0.0, "float32", True),
    ],
)
def test_eps_thresholds(eps, dtype, underflows):
    assert adam_eps_underflows(eps, dtype) is underflows


def test_squared_eps():
    assert adam_eps_underflows(1e-4, "float16", squared=True)
    assert not adam_eps_underflows(1e-2, "float16", squared=True)


def test_check_adam_eps_explains_nan_and_fixes():
    text = check_adam_eps("Adam", 1e-8, "float16")
    assert text is not None
    assert "eps=1e-08 underflows to 0 in float16" in text
    assert "0/0 = NaN" in text
    assert "'O2'" in text and "eps >= 0.0001" in text
    assert check_adam_eps("Adam", 1e-8, "bfloat16") is None
    assert check_adam_eps("Adam", 1e-4, "float16") is None


def test_check_adam_eps_for_imprecise_subnormal():
    text = check_adam_eps("AdamW", 5e-8, "float16")
    assert text is not None and "smallest subnormal" in text


def test_scaler_without_masters_lists_params_and_fix():
    names = [f"layer{i}.weight" for i in range(20)]
    with pytest.raises(WrapError) as err:
        check_scaler_without_masters(True, names)
    message = str(err.value)
    assert "layer0.weight" in message and "layer7.weight" in message
    assert "layer8.weight" not in message and "and 12 more" in message
    assert "'O2'" in message and "loss_scale='none'" in message


def test_scaler_without_masters_passes_when_fine():
    check_scaler_without_masters(False, ["w"])
    check_scaler_without_masters(True, [])


def test_scaler_without_masters_accepts_a_policy():
    policy = SimpleNamespace(loss_scale=SimpleNamespace(enabled=True))
    with pytest.raises(WrapError, match=r"fc\.weight"):
        check_scaler_without_masters(policy, ["fc.weight"])
    policy.loss_scale.enabled = False
    check_scaler_without_masters(policy, ["fc.weight"])
