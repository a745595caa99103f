"""mixprec.mxnet.Trainer: conversion in place, the step, skips, the loss scale, clipping."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

from _mx_nets import batch, bf16_computes, cnn, master_values, mlp, train_step, values  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

import mixprec.mxnet  # noqa: E402
from mixprec.errors import (  # noqa: E402
    MixprecError,
    MixprecWarning,
    StepOrderError,
    UnsupportedDtypeError,
    WrapError,
)
from mixprec.kit import DynamicScale  # noqa: E402
from mixprec_mxnet import Trainer, state  # noqa: E402
from mixprec_mxnet.bf16_kernels import Bf16IslandWarning  # noqa: E402
from mixprec_mxnet.dtypes import dtype_of  # noqa: E402

pytestmark = pytest.mark.mxnet

L2 = gluon.loss.L2Loss()
CE = gluon.loss.SoftmaxCrossEntropyLoss()


def test_facade_and_gluon_habits() -> None:
    assert mixprec.mxnet.Trainer is Trainer
    net = mlp()
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O1-bf16")
    assert isinstance(trainer, gluon.Trainer)
    assert trainer.learning_rate == 0.1
    trainer.set_learning_rate(0.05)
    assert trainer.optimizer.learning_rate == 0.05
    assert trainer.policy.name == "O1-bf16"


def test_o2_converts_the_same_net_in_place() -> None:
    net = cnn()
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
    dtypes = {name: dtype_of(p.data()) for name, p in net._collect_params_with_prefix().items()}
    assert dtypes["0.weight"] == dtypes["9.weight"] == "bfloat16"
    assert {dtypes[k] for k in dtypes if k.startswith(("1.", "4."))} == {"float32"}  # BatchNorm
    assert {dtype_of(m.data()) for m in trainer.master_params()} == {"float32"}
    x, y = batch(image=True)
    with autograd.record():
        out = net(x)
    assert dtype_of(out) == "float32"  # output=float32
    train_step(net, trainer, x, y, CE)
    assert dtype_of(net[0].weight.data()) == "bfloat16"


def test_masters_track_the_model() -> None:
    net = mlp()
    trainer = Trainer(net, "adam", {"learning_rate": 0.01}, policy="O2-bf16")
    x, y = batch()
    for _ in range(3):
        train_step(net, trainer, x, y, L2)
    model, masters = values(net), master_values(trainer, net)
    for name in model:
        assert np.abs(model[name] - masters[name]).max() <= np.abs(masters[name]).max() * 2**-8
        assert not np.array_equal(masters[name], model[name]) or name.endswith("bias")


def test_update_on_kvstore_is_refused() -> None:
    with pytest.raises(MixprecError, match="update_on_kvstore"):
        Trainer(mlp(), "sgd", policy="O2-bf16", update_on_kvstore=True)


def test_fp16_on_cpu_is_refused_with_the_bf16_preset_suggested() -> None:
    with pytest.raises(UnsupportedDtypeError, match="O2-bf16") as err:
        Trainer(mlp(), "sgd", policy="O2")
    assert "float16" in str(err.value) and "CPU" in str(err.value)
    with pytest.raises(UnsupportedDtypeError, match="O1-bf16"):
        Trainer(mlp(), "sgd", policy="16-mixed")


def _traced_steps(policy: str, injected: set[int], steps: int, **overrides):
    net = mlp()
    trainer = Trainer(
        net, "sgd", {"learning_rate": 0.05, "momentum": 0.9}, policy=policy, **overrides
    )
    x, y = batch()
    used = []
    for i in range(steps):
        with autograd.record():
            loss = L2(net(x), y).mean()
            with trainer.scale_loss(loss) as scaled:
                used.append(float((scaled / loss).asscalar()) if trainer.scaler.enabled else 1.0)
                autograd.backward(scaled)
        if i in injected:
            net[0].weight.grad()[0, 0] = float("nan")
        trainer.step(1)
    return trainer, used


def test_scale_trace_equals_the_core_state_machine_with_no_lag() -> None:
    config = DynamicScale(init=2.0**10, interval=2)
    injected = {1, 2, 6}
    trainer, used = _traced_steps("O2-bf16", injected, 8, loss_scale=config)
    expected, reference = [], config
    for i in range(8):
        expected.append(reference.scale)
        reference = reference.update(i in injected).state
    assert used == expected  # each step ran at the scale the previous update produced
    assert trainer.loss_scale == reference.scale
    assert trainer.skipped_steps == len(injected)


def test_inf_skips_the_step_and_backs_off() -> None:
    net = mlp()
    trainer = Trainer(net, "adam", {"learning_rate": 0.01}, policy="O2-bf16", loss_scale="dynamic")
    x, y = batch()
    train_step(net, trainer, x, y, L2)
    before, masters = values(net), master_values(trainer, net)
    states = {i: [a.asnumpy() for a in s] for i, s in trainer._updaters[0].states.items()}
    counts = dict(trainer.optimizer._index_update_count)
    scale = trainer.loss_scale
    train_step(net, trainer, x, y, L2, inject=True)
    assert trainer.last_step_skipped and trainer.skipped_steps == 1
    assert trainer.loss_scale == scale / 2
    assert all(np.array_equal(before[k], v) for k, v in values(net).items())
    assert all(np.array_equal(masters[k], v) for k, v in master_values(trainer, net).items())
    after = {i: [a.asnumpy() for a in s] for i, s in trainer._updaters[0].states.items()}
    assert all(
        np.array_equal(a, b) for i in states for a, b in zip(states[i], after[i], strict=True)
    )
    assert dict(trainer.optimizer._index_update_count) == counts
    assert [e.kind for e in trainer.events] == ["skip", "backoff"]
    snapshot = state(trainer)
    assert snapshot.skipped_steps == 1 and snapshot.loss_scale == trainer.loss_scale
    train_step(net, trainer, x, y, L2)
    assert not trainer.last_step_skipped
    assert not np.array_equal(values(net)["1.weight"], before["1.weight"])


def test_bf16_default_has_no_scaling_but_still_skips_nan() -> None:
    trainer, used = _traced_steps("O1-bf16", {1}, 3)
    assert not trainer.scaler.enabled and used == [1.0, 1.0, 1.0]
    assert trainer.skipped_steps == 1


def test_plain_backward_works_without_scaling() -> None:
    net = mlp()
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O1-bf16")
    x, y = batch()
    before = values(net)["0.weight"]
    with autograd.record():
        loss = L2(net(x), y)
    loss.backward()
    trainer.step(8)
    assert not np.array_equal(values(net)["0.weight"], before)


def test_scale_loss_right_after_the_record_block() -> None:
    net = mlp()
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16", loss_scale="dynamic")
    x, y = batch()
    with autograd.record():
        loss = L2(net(x), y)
    with trainer.scale_loss(loss) as scaled:
        autograd.backward(scaled)
    assert float(trainer.master_params()[0].grad().abs().sum().asscalar()) == 0.0
    trainer.step(8)
    assert not trainer.last_step_skipped


def test_step_order_errors_name_the_fix() -> None:
    net = mlp()
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16", loss_scale="dynamic")
    x, y = batch()
    with autograd.record():
        loss = L2(net(x), y)
    loss.backward()  # not scaled: with loss scaling on, step cannot know what to unscale
    with pytest.raises(StepOrderError, match="scale_loss"):
        trainer.step(8)
    with autograd.record():
        loss = L2(net(x), y)
        with trainer.scale_loss(loss) as scaled:
            autograd.backward(scaled)
    trainer.unscale()
    with pytest.raises(StepOrderError, match="already"):
        trainer.unscale()


def test_clipping_through_allreduce_unscale_update() -> None:
    net = mlp()
    lr, max_norm = 0.5, 1e-3
    trainer = Trainer(net, "sgd", {"learning_rate": lr}, policy="O2-bf16", loss_scale="dynamic")
    x, y = batch()
    before = master_values(trainer, net)
    with autograd.record():
        loss = L2(net(x), y).sum()
        with trainer.scale_loss(loss) as scaled:
            autograd.backward(scaled)
    trainer.allreduce_grads()
    mixprec.mxnet.unscale_(trainer)  # the PyTorch backend's name for trainer.unscale()
    grads = trainer.master_grads()
    assert {dtype_of(g) for g in grads} == {"float32"}
    norm = gluon.utils.clip_global_norm(grads, max_norm)
    assert norm > 10 * max_norm  # the true (unscaled) norm, so clipping did something
    trainer.update(1)
    after = master_values(trainer, net)
    moved = np.sqrt(sum(((after[k] - before[k]) ** 2).sum() for k in after))
    assert moved == pytest.approx(lr * max_norm, rel=1e-3)


@pytest.mark.cpu_isa
def test_parameter_dict_gets_casting_and_masters_but_a_warning() -> None:
    net = mlp()
    with pytest.warns(MixprecWarning, match="not the net") as caught:
        trainer = Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
    assert dtype_of(net[0].weight.data()) == "bfloat16"
    if bf16_computes("FullyConnected") == "bfloat16":
        x, y = batch()
        with autograd.record():
            out = net(mixprec.mxnet.cast(x, "bfloat16"))  # the user casts at the boundary
            loss = L2(mixprec.mxnet.cast(out, "float32"), y)
            with trainer.scale_loss(loss) as scaled:
                autograd.backward(scaled)
        trainer.step(8)
    else:  # no net, so no islands: the warning says the user must cast around Dense
        message = str(caught[0].message)
        assert "float32 islands for" in message and "FullyConnected" in message
    with pytest.warns(MixprecWarning, match="op casting"):
        Trainer(mlp().collect_params(), "sgd", policy="O1-bf16")
    net = cnn()  # BatchNorm parameters are recognised by name and stay float32
    with pytest.warns(MixprecWarning):
        Trainer(net.collect_params(), "sgd", policy="O2-bf16")
    assert {dtype_of(p.data()) for p in net[1].collect_params().values()} == {"float32"}
    assert dtype_of(net[0].weight.data()) == "bfloat16"


def _frozen_bn_run(policy: str) -> tuple[list[float], dict, dict, Any]:
    net = cnn(frozen_bn=True)  # BatchNorm(use_global_stats=True): inference mode in training
    for name, p in net._collect_params_with_prefix().items():
        if name.startswith(("1.", "4.")):
            p.grad_req = "null"
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1, "momentum": 0.9}, policy=policy)
    x, y = batch(n=32, image=True)
    before = values(net)
    losses = [train_step(net, trainer, x, y, CE) for _ in range(20)]
    return losses, before, values(net), net


def test_frozen_batchnorm_fine_tuning_under_o2_bf16() -> None:
    losses, before, after, net = _frozen_bn_run("O2-bf16")
    frozen = [k for k in before if k.startswith(("1.", "4."))]
    assert frozen and all(np.array_equal(before[k], after[k]) for k in frozen)
    assert {dtype_of(p.data()) for p in net[1].collect_params().values()} == {"float32"}
    assert not np.array_equal(before["0.weight"], after["0.weight"])
    reference, _, _, _ = _frozen_bn_run("O0")
    assert losses[-1] < 0.8 * losses[0]
    assert losses[-1] == pytest.approx(reference[-1], rel=0.02)


def test_deferred_shapes_are_cast_at_the_first_forward() -> None:
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(16, activation="relu"), gluon.nn.Dense(4))
    net.initialize()
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
    assert trainer.masters is None
    x, y = batch()
    train_step(net, trainer, x, y, L2)
    assert dtype_of(net[0].weight.data()) == "bfloat16"
    assert dtype_of(trainer.masters.master_for(net[0].weight).data()) == "float32"


def test_parameters_with_deferred_shapes_without_the_net_are_refused() -> None:
    """Given only parameters, the Trainer never sees the forward pass that shapes them."""
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(4))
    net.initialize()
    with pytest.raises(WrapError, match=r"Trainer\(net, \.\.\.\)"):
        Trainer(net.collect_params(), "sgd", policy="O2-bf16")
    assert dtype_of(net[0].bias.data()) == "float32"


@pytest.mark.cpu_isa
def test_adam_eps_lint_checks_the_dtype_the_optimizer_state_lives_in() -> None:
    with pytest.warns(MixprecWarning, match="eps"):  # 1e-45 is below even float32's range
        Trainer(mlp(), "adam", {"epsilon": 1e-45}, policy="O3-bf16")
    with warnings.catch_warnings():  # bf16 weights are updated through float32 copies
        warnings.simplefilter("error", MixprecWarning)
        warnings.simplefilter("ignore", Bf16IslandWarning)  # asserted in test_mx_islands.py
        Trainer(mlp(), "adam", {"epsilon": 1e-42}, policy="O3-bf16")  # < bf16 subnormals


def test_a_pinned_module_is_an_island_with_its_children() -> None:
    net = gluon.nn.HybridSequential()
    inner = gluon.nn.HybridSequential()
    inner.add(gluon.nn.Dense(16, in_units=16, activation="relu"), gluon.nn.Dense(16, in_units=16))
    net.add(gluon.nn.Dense(16, in_units=8), inner, gluon.nn.Dense(4, in_units=16))
    net.initialize()
    policy = mixprec.get_policy("O2-bf16").with_module("1", "float32", match="path")
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy=policy)
    assert dtype_of(net[0].weight.data()) == dtype_of(net[2].weight.data()) == "bfloat16"
    assert {dtype_of(p.data()) for p in inner.collect_params().values()} == {"float32"}
    x, y = batch()
    net.hybridize()
    train_step(net, trainer, x, y, L2)
    assert not trainer.last_step_skipped
