"""Edits of ``param.grad()`` between ``allreduce_grads()`` and ``update()`` (issue 37).

``gluon.Trainer`` users zero, clip or poison ``param.grad()`` after ``allreduce_grads()``
and before ``update()``; under O2-bf16 the update applies the float32 masters' gradients,
and such an edit used to be neither checked (an inf did not skip the step) nor applied (a
zeroed gradient still moved the weights). Found by calling the three methods by hand.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

from _mx_nets import batch, master_values, mlp  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

from mixprec_mxnet import Trainer  # noqa: E402

pytestmark = pytest.mark.mxnet

L2 = gluon.loss.L2Loss()
LR = 0.5


def _backward(policy: str = "O2-bf16", **overrides: Any) -> tuple[Any, Trainer]:
    net = mlp()
    trainer = Trainer(net, "sgd", {"learning_rate": LR}, policy=policy, **overrides)
    x, y = batch()
    with autograd.record():
        loss = L2(net(x), y).sum()
        with trainer.scale_loss(loss) as scaled:
            autograd.backward(scaled)
    return net, trainer


def _params(net: Any) -> list[Any]:
    return [p for p in net.collect_params().values() if p.grad_req != "null"]


def _moved(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> dict[str, float]:
    return {k: float(np.abs(after[k] - before[k]).max()) for k in before}


@pytest.mark.parametrize("policy", ["O2-bf16"])
def test_a_zeroed_gradient_is_applied(policy: str) -> None:
    net, trainer = _backward(policy)
    before = master_values(trainer, net)
    trainer.allreduce_grads()
    for p in _params(net):
        p.grad()[:] = 0
    trainer.update(1)
    assert set(_moved(before, master_values(trainer, net)).values()) == {0.0}
    assert trainer.skipped_steps == 0


@pytest.mark.parametrize("scaling", ["none", "dynamic"])
def test_an_inf_written_into_a_gradient_skips_the_step(scaling: str) -> None:
    net, trainer = _backward(loss_scale=scaling)
    before = master_values(trainer, net)
    trainer.allreduce_grads()
    if scaling == "dynamic":
        trainer.unscale()
    grad = net[0].weight.grad()
    grad[0, 0] = float("inf")
    trainer.update(1)
    assert trainer.skipped_steps == 1
    assert set(_moved(before, master_values(trainer, net)).values()) == {0.0}
    assert "0.weight" in trainer._mixprec.overflows[-1].params


def test_a_gradient_clipped_by_hand_is_applied() -> None:
    net, plain = _backward()
    before = master_values(plain, net)
    plain.step(1)
    full = _moved(before, master_values(plain, net))

    net, trainer = _backward()
    before = master_values(trainer, net)
    trainer.allreduce_grads()
    for p in _params(net):
        g = p.grad()
        g[:] = g * 0.25
    trainer.update(1)
    clipped = _moved(before, master_values(trainer, net))
    for name, moved in clipped.items():  # a quarter of the step, to bfloat16 rounding
        assert moved == pytest.approx(0.25 * full[name], rel=2e-2), name


def test_untouched_gradients_keep_the_masters_float32_values() -> None:
    """allreduce_grads() + update() with no edit is the step itself, bit for bit; and the
    documented clipping of trainer.master_grads() is not undone by the edit check."""
    net_a, a = _backward(loss_scale="dynamic")
    a.step(1)
    net_b, b = _backward(loss_scale="dynamic")
    b.allreduce_grads()
    b.unscale()
    b.update(1)
    va, vb = master_values(a, net_a), master_values(b, net_b)
    assert all(np.array_equal(va[k], vb[k]) for k in va)

    net, trainer = _backward()
    before = master_values(trainer, net)
    trainer.allreduce_grads()
    for g in trainer.master_grads():
        g[:] = 0
    trainer.update(1)
    assert set(_moved(before, master_values(trainer, net)).values()) == {0.0}
