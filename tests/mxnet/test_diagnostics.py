"""Diagnostics in the MXNet backend: dtype report, overflowing parameters, underflow."""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mxnet")

from _mx_nets import batch, bf16_computes, cnn, mlp, train_step  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

import mixprec.mxnet  # noqa: E402
from mixprec.errors import WrapError  # noqa: E402
from mixprec_mxnet import Trainer  # noqa: E402

pytestmark = pytest.mark.mxnet

L2 = gluon.loss.L2Loss()


@pytest.mark.cpu_isa
def test_o2_report_shows_batchnorm_float32_by_class_rule_and_conv_bf16() -> None:
    net = cnn()
    Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
    lines = {line.split()[0]: line for line in mixprec.mxnet.dtype_report(net).splitlines()[2:]}
    assert lines["1"].split()[1:4] == ["BatchNorm", "float32", "float32"]
    assert lines["1"].endswith("pinned by class rule *BatchNorm*")
    conv = bf16_computes("Convolution")  # float32: an island where the CPU has no kernel
    assert lines["0"].split()[1:4] == ["Conv2D", "bfloat16", conv]
    if conv == "float32":
        assert lines["0"].endswith("float32 island: no bfloat16 Convolution kernel here")
    with pytest.raises(WrapError, match="Trainer"):
        mixprec.mxnet.dtype_report(cnn())


def test_skipped_step_names_exactly_the_parameter_that_overflowed() -> None:
    net = mlp()
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16", loss_scale="dynamic")
    x, y = batch()
    train_step(net, trainer, x, y, L2)
    assert mixprec.mxnet.overflowing_params(trainer) == []
    train_step(net, trainer, x, y, L2, inject=True)  # inf in the first parameter's gradient
    assert trainer.last_step_skipped
    assert mixprec.mxnet.overflowing_params(trainer) == ["0.weight"]
    assert [r.step for r in mixprec.mxnet.overflow_records(net)] == [1]


@pytest.mark.parametrize(("value", "expected"), [(1e-6, 1.0), (1e-2, 0.0)])
def test_underflow_fraction_in_float16_terms(value: float, expected: float) -> None:
    net = mlp()
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16", loss_scale="dynamic")
    x, _ = batch()
    weight = net[0].weight
    with autograd.record():
        loss = (weight.data().astype("float32") * value).sum() + 0 * net(x).astype("float32").sum()
        with trainer.scale_loss(loss) as scaled:
            autograd.backward(scaled)
    assert mixprec.mxnet.underflow_fraction(trainer)["0.weight"] == pytest.approx(expected)
    trainer.unscale()
    assert mixprec.mxnet.underflow_fraction(trainer)["0.weight"] == pytest.approx(expected)
    assert mixprec.mxnet.underflow_fraction(trainer, "bfloat16")["0.weight"] == 0.0
