"""Saving and resuming: float32 parameter files, scaler and policy in the states, bit-exact."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

from _mx_nets import batch, cnn, mlp, train_step, values  # noqa: E402
from mxnet import gluon, nd  # noqa: E402

from mixprec.errors import CheckpointError  # noqa: E402
from mixprec_mxnet import Trainer  # noqa: E402
from mixprec_mxnet.dtypes import dtype_of  # noqa: E402

pytestmark = pytest.mark.mxnet

CE = gluon.loss.SoftmaxCrossEntropyLoss()
L2 = gluon.loss.L2Loss()
STEPS, SAVE_AT, INJECT_AT = 6, 3, 1
POLICIES = {
    "O2-bf16+dynamic": ("O2-bf16", {"loss_scale": "dynamic(init=1024,interval=1)"}),
    "O1-bf16": ("O1-bf16", {}),
    "O3-bf16": ("O3-bf16", {}),
    "O0": ("O0", {}),
}


def _trainer(net, policy):
    spec, overrides = POLICIES[policy]
    return Trainer(net, "adam", {"learning_rate": 0.01}, policy=spec, **overrides)


def _steps(net, trainer, start, stop):
    x, y = batch(n=16, image=True)
    for i in range(start, stop):
        train_step(net, trainer, x, y, CE, inject=i == INJECT_AT)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_resume_is_bit_identical(policy: str, tmp_path: Path) -> None:
    net = cnn()
    trainer = _trainer(net, policy)
    _steps(net, trainer, 0, STEPS)
    uninterrupted = values(net)

    net = cnn()
    trainer = _trainer(net, policy)
    _steps(net, trainer, 0, SAVE_AT)
    net.save_parameters(str(tmp_path / "net.params"))
    trainer.save_states(str(tmp_path / "trainer.states"))
    saved_scale, saved_skips = trainer.loss_scale, trainer.skipped_steps

    saved = nd.load(str(tmp_path / "net.params"))
    assert {dtype_of(v) for v in saved.values()} == {"float32"}
    masters = {
        k: trainer.masters.master_for(p).data().asnumpy()
        for k, p in net._collect_params_with_prefix().items()
    }
    assert all(np.array_equal(saved[k].asnumpy(), masters[k]) for k in masters)

    fresh = cnn(seed=7)  # other initial values: everything must come from the files
    resumed = _trainer(fresh, policy)
    fresh.load_parameters(str(tmp_path / "net.params"))
    resumed.load_states(str(tmp_path / "trainer.states"))
    assert (resumed.loss_scale, resumed.skipped_steps) == (saved_scale, saved_skips)
    _steps(fresh, resumed, SAVE_AT, STEPS)
    after = values(fresh)
    assert all(np.array_equal(uninterrupted[k], after[k]) for k in uninterrupted)


def test_loading_before_building_the_trainer_resumes_too(tmp_path: Path) -> None:
    net = mlp()
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1, "momentum": 0.9}, policy="O2-bf16")
    x, y = batch()
    for _ in range(2):
        train_step(net, trainer, x, y, L2)
    net.save_parameters(str(tmp_path / "p"))
    trainer.save_states(str(tmp_path / "s"))
    train_step(net, trainer, x, y, L2)

    fresh = mlp(seed=3)
    fresh.load_parameters(str(tmp_path / "p"))  # a plain float32 Gluon file
    resumed = Trainer(fresh, "sgd", {"learning_rate": 0.1, "momentum": 0.9}, policy="O2-bf16")
    resumed.load_states(str(tmp_path / "s"))
    train_step(fresh, resumed, x, y, L2)
    assert all(np.array_equal(values(net)[k], v) for k, v in values(fresh).items())


def test_states_carry_the_policy(tmp_path: Path) -> None:
    net = mlp()
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
    trainer.save_states(str(tmp_path / "s"))
    other = Trainer(mlp(), "sgd", {"learning_rate": 0.1}, policy="O1-bf16")
    with pytest.raises(CheckpointError, match="O2-bf16"):
        other.load_states(str(tmp_path / "s"))


def test_parameter_dict_trainer_saves_float32_by_parameter_name(tmp_path: Path) -> None:
    net = mlp()
    with pytest.warns(Warning):
        trainer = Trainer(net.collect_params(), "sgd", policy="O3-bf16")
    trainer.save_parameters(str(tmp_path / "p"))
    saved = nd.load(str(tmp_path / "p"))
    assert set(saved) == set(net.collect_params().keys())
    assert {dtype_of(v) for v in saved.values()} == {"float32"}
    trainer.load_parameters(str(tmp_path / "p"))
    assert dtype_of(net[0].weight.data()) == "bfloat16"
