"""float16 on GPU contexts (skipped without a CUDA build of MXNet and a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

from _mx_nets import batch, master_values, mlp, train_step  # noqa: E402
from mxnet import gluon  # noqa: E402

from mixprec_mxnet import Trainer  # noqa: E402
from mixprec_mxnet.dtypes import dtype_of  # noqa: E402

pytestmark = [
    pytest.mark.mxnet,
    pytest.mark.cuda,
    pytest.mark.skipif(mx.context.num_gpus() == 0, reason="needs MXNet with a CUDA GPU"),
]

L2 = gluon.loss.L2Loss()


@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_float16_trains_on_gpu_with_dynamic_scaling(policy: str) -> None:
    ctx = mx.gpu(0)
    net = mlp(ctx=ctx)
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1, "momentum": 0.9}, policy=policy)
    assert trainer.policy.compute == "float16" and trainer.scaler.enabled
    x, y = batch()
    x, y = x.as_in_context(ctx), y.as_in_context(ctx)
    losses = [train_step(net, trainer, x, y, L2) for _ in range(10)]
    assert losses[-1] < losses[0]
    if policy == "O2":
        assert dtype_of(net[0].weight.data(ctx)) == "float16"
        assert all(np.isfinite(v).all() for v in master_values(trainer, net).values())
    train_step(net, trainer, x, y, L2, inject=True)
    assert trainer.last_step_skipped
