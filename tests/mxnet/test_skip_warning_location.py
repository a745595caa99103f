"""RepeatedSkipWarning on Gluon points at the user's ``trainer.step`` and names no rank in a
run of one process (issue 37)."""

from __future__ import annotations

import inspect
import math
import warnings

import pytest

mx = pytest.importorskip("mxnet")

import numpy as np  # noqa: E402
from mxnet import autograd, gluon, nd  # noqa: E402

import mixprec.mxnet as mpx  # noqa: E402
from mixprec import StepGuard  # noqa: E402
from mixprec.kit import RepeatedSkipWarning  # noqa: E402


@pytest.mark.parametrize("preset", ["O0", "O2-bf16"])
def test_the_gluon_skip_warning_points_at_the_users_step(preset: str) -> None:
    mx.random.seed(0)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(4, in_units=3), gluon.nn.Activation("relu"), gluon.nn.Dense(2))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    trainer = mpx.Trainer(
        net, "sgd", {"learning_rate": 0.05}, policy=preset, guard=StepGuard(warn_after=3)
    )
    x = nd.array(np.random.default_rng(0).standard_normal((8, 3)))
    x[1, 0] = math.nan
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with autograd.record():
                loss = (net(x).astype("float32") ** 2).mean()
            with trainer.scale_loss(loss) as scaled:
                autograd.backward(scaled)
            trainer.step(8)  # the user's step
    (warned,) = [w for w in caught if issubclass(w.category, RepeatedSkipWarning)]
    lines, start = inspect.getsourcelines(test_the_gluon_skip_warning_points_at_the_users_step)
    line = start + next(i for i, text in enumerate(lines) if "# the user's step" in text)
    assert (warned.filename, warned.lineno) == (__file__, line)
    assert "rank" not in str(warned.message)
