"""Several contexts with kvstore 'device': same training as one context; skips together."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

from _mx_nets import batch, master_values, mlp, values  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

from mixprec_mxnet import Trainer  # noqa: E402

pytestmark = pytest.mark.mxnet

L2 = gluon.loss.L2Loss()
STEPS = 4


def _run(contexts, policy, inject_at=None, kvstore="device"):
    net = mlp(ctx=contexts)
    trainer = Trainer(
        net,
        "sgd",
        {"learning_rate": 0.1, "momentum": 0.9},
        policy=policy,
        kvstore=kvstore,
        loss_scale="dynamic",
    )
    x, y = batch(n=8)
    xs, ys = gluon.utils.split_and_load(x, contexts), gluon.utils.split_and_load(y, contexts)
    skipped = []
    for step in range(STEPS):
        with autograd.record():
            losses = [L2(net(a), b) for a, b in zip(xs, ys, strict=True)]
        for loss in losses:
            with trainer.scale_loss(loss) as scaled:
                autograd.backward(scaled)
        if step == inject_at:
            net[0].weight.grad(contexts[-1])[0, 0] = float("nan")
        trainer.step(8)
        skipped.append(trainer.last_step_skipped)
    return net, trainer, skipped


@pytest.mark.parametrize("policy", ["O2-bf16", "O1-bf16"])
def test_two_contexts_train_like_one(policy: str) -> None:
    one_net, one, _ = _run([mx.cpu(0)], policy)
    contexts = [mx.cpu(0), mx.cpu(1)]
    two_net, two, _ = _run(contexts, policy)
    assert two._kvstore is not None and "device" in two._kvstore.type
    reference, got = master_values(one, one_net), master_values(two, two_net)
    for name in reference:
        np.testing.assert_allclose(got[name], reference[name], rtol=2e-2, atol=2e-3)
    per_context = [values(two_net, ctx) for ctx in contexts]
    assert all(np.array_equal(per_context[0][k], per_context[1][k]) for k in per_context[0])


def test_inf_on_one_context_skips_the_step_everywhere() -> None:
    contexts = [mx.cpu(0), mx.cpu(1)]
    net, trainer, skipped = _run(contexts, "O2-bf16", inject_at=1)
    assert skipped == [False, True, False, False]
    assert trainer.loss_scale == 2.0**15
    for ctx in contexts:
        assert all(np.isfinite(v).all() for v in values(net, ctx).values())


def test_local_kvstore_works_too() -> None:
    net, trainer, skipped = _run([mx.cpu(0), mx.cpu(1)], "O2-bf16", kvstore="local")
    assert not any(skipped) and trainer.reduce_dtype(net[0].weight) == "float32"
