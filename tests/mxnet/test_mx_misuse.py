"""Gluon misuse that used to mislead: each is a MixprecError naming the fix, raised first."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

from _mx_nets import batch, mlp, values  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

from mixprec.errors import WrapError  # noqa: E402
from mixprec_mxnet import Trainer  # noqa: E402

pytestmark = pytest.mark.mxnet


def test_a_list_of_arrays_is_refused_naming_the_net() -> None:
    net = mlp()
    arrays = [p.data() for p in net.collect_params().values()]
    with pytest.raises(WrapError, match=r"NDArray objects.*Trainer\(net, \.\.\.\)"):
        Trainer(arrays, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")


def test_no_parameters_are_refused() -> None:
    with pytest.raises(WrapError, match="got no parameters"):
        Trainer([], "sgd", {"learning_rate": 0.1}, policy="O0")


@pytest.mark.parametrize("batch_size", [0, -8, None])
def test_a_step_without_a_positive_batch_size_changes_nothing(batch_size: object) -> None:
    net = mlp()
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16",
                      loss_scale="dynamic(init=1024,interval=1)")  # fmt: skip
    x, y = batch()
    with autograd.record():
        loss = gluon.loss.L2Loss()(net(x), y)
        with trainer.scale_loss(loss) as scaled:
            autograd.backward(scaled)
    before = values(net)
    with pytest.raises(WrapError, match=r"positive batch size.*x\.shape\[0\]"):
        trainer.step(batch_size)  # type: ignore[arg-type]
    assert (trainer.scaler.steps, trainer.loss_scale) == (0, 1024.0)
    assert all(np.array_equal(before[k], v) for k, v in values(net).items())
    trainer.step(x.shape[0])  # the backward is still pending: the real step goes through
    assert trainer.scaler.steps == 1


@pytest.mark.parametrize("policy", ["O1-fp8", "O2-fp8,fp8=delayed"])
def test_an_fp8_policy_is_refused_before_the_net_changes(policy: str) -> None:
    from mixprec.errors import UnsupportedDtypeError

    net = mlp()
    before = values(net)
    dtypes = {name: p.dtype for name, p in net.collect_params().items()}
    with pytest.raises(UnsupportedDtypeError, match=r"fp8.*(O1-bf16|O2-bf16)"):
        Trainer(net, "sgd", {"learning_rate": 0.1}, policy=policy)
    assert {name: p.dtype for name, p in net.collect_params().items()} == dtypes
    assert all(np.array_equal(before[k], v) for k, v in values(net).items())
