"""Diagnostics in the PyTorch backend: dtype report, overflowing parameters, underflow."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from _torch_nets import mlp, train_step  # noqa: E402
from torch import nn  # noqa: E402

import mixprec  # noqa: E402
import mixprec.torch as mpt  # noqa: E402
from mixprec.errors import WrapError  # noqa: E402


def _wrapped(policy: str, **kw: object) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = mlp(batchnorm=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return mpt.wrap(model, opt, policy=policy, **kw)  # type: ignore[no-any-return]


def test_o2_report_shows_batchnorm_float32_by_class_rule_and_linear_bf16() -> None:
    model, _ = _wrapped("O2-bf16")
    lines = {line.split()[0]: line for line in mpt.dtype_report(model).splitlines()[2:]}
    assert lines["1"].split()[1:4] == ["BatchNorm1d", "float32", "float32"]
    assert lines["1"].endswith("pinned by class rule *BatchNorm*")
    assert lines["0"].split()[1:4] == ["Linear", "bfloat16", "bfloat16"]
    assert "2" not in lines  # ReLU: no parameters, no rule
    with pytest.raises(WrapError, match="wrap it first"):
        mpt.dtype_report(mlp())


def test_skipped_step_names_exactly_the_parameter_that_overflowed() -> None:
    model, opt = _wrapped("O2", loss_scale="dynamic")
    seen: list[list[str]] = []
    train_step(model, opt, 0)
    assert mpt.overflowing_params(opt) == []
    mpt.state(opt).events.subscribe(lambda ev: seen.append(mpt.overflowing_params(opt)))
    opt.zero_grad()
    loss = model(torch.randn(8, 16)).float().mean()
    with mpt.scale_loss(loss, opt) as scaled:
        scaled.backward()
    model[3].weight.grad.view(-1)[5] = float("nan")
    opt.step()
    assert mpt.state(opt).last_step_skipped
    assert mpt.overflowing_params(opt) == ["3.weight"]
    assert seen and seen[0] == ["3.weight"]  # known when the skip event is delivered
    assert mpt.overflow_records(opt) == [mixprec.OverflowRecord(1, ("3.weight",))]
    train_step(model, opt, 2)  # a normal step keeps the latest skip's record
    assert mpt.overflowing_params(opt) == ["3.weight"]


@pytest.mark.parametrize(("value", "expected"), [(1e-6, 1.0), (1e-2, 0.0)])
def test_underflow_fraction_in_float16_terms(value: float, expected: float) -> None:
    model, opt = _wrapped("O2-bf16", loss_scale="dynamic")
    weight = model[0].weight
    loss = (weight.float() * value).sum() + 0 * model(torch.randn(4, 16)).float().sum()
    with mpt.scale_loss(loss, opt) as scaled:
        scaled.backward()
    before = mpt.underflow_fraction(model)  # scaled model gradients, divided by the scale
    assert before["0.weight"] == pytest.approx(expected)
    mpt.unscale_(opt)
    after = mpt.underflow_fraction(opt, dtype="float16")  # the unscaled masters
    assert after["0.weight"] == pytest.approx(expected)
    assert mpt.underflow_fraction(opt, dtype="bfloat16")["0.weight"] == 0.0
    opt.step()
