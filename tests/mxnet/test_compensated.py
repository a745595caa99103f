"""master=kahan and master=stochastic on Gluon: the NumPy reference's arithmetic around the
MXNet optimizer, small updates that survive bfloat16 weights, checkpoints that save weight +
compensation and resume bit for bit, and the refusals."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")
reference = pytest.importorskip("mixprec_numpy.compensation")

from _mx_nets import (  # noqa: E402
    array,
    batch,
    master_values,
    mlp,
    rewrite_states,
    train_replicas,
    values,
)
from mxnet import autograd, gluon  # noqa: E402

from mixprec.errors import CheckpointError, PolicyError, WrapError  # noqa: E402
from mixprec_mxnet import Trainer  # noqa: E402
from mixprec_mxnet.diagnostics import dtype_report  # noqa: E402

pytestmark = pytest.mark.mxnet

STRATEGIES = ["O3-bf16-kahan", "O3-bf16-sr"]


@pytest.fixture(autouse=True)
def _own_block_names() -> Iterator[None]:
    """Name this file's blocks from a counter of its own: the process-wide one decides how
    gluon.Trainer numbers parameters (it sorts them by name), which later test files'
    simulated kvstores rely on."""
    with mx.name.NameManager():
        yield


L2 = gluon.loss.L2Loss()
STEPS = 200
LR = 2**-12  # an eighth of half the bfloat16 spacing at 1.0: rounds away in plain bfloat16


def _pushed(policy: str) -> float:
    """Weights of 1.0 pushed up by LR per step; how far the saved float32 value moved."""
    net = gluon.nn.Dense(1, in_units=64, use_bias=False)
    net.initialize(mx.init.One())
    trainer = Trainer(net, "sgd", {"learning_rate": LR}, policy=policy, seed=5)
    x = mx.nd.ones((1, 64))
    for _ in range(STEPS):
        with autograd.record():
            loss = -net(x).astype("float32").sum()
        loss.backward()
        trainer.step(1)
    return _saved_mean(net) - 1.0


def _saved_mean(net: gluon.Block) -> float:
    path = "weights.params"
    net.save_parameters(path)
    return float(mx.nd.load(path)["weight"].asnumpy().mean())


def test_small_updates_survive_the_strategies_and_vanish_in_plain_bfloat16(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    wanted = STEPS * LR
    assert _pushed("O3-bf16") == 0.0
    assert _pushed("O2-bf16") == pytest.approx(wanted, rel=1e-5)
    assert _pushed("O3-bf16-kahan") == pytest.approx(wanted, rel=1e-3)
    # unbiased, not exact: the mean of 64 weights is off by about 0.05 * wanted (1 sd)
    assert _pushed("O3-bf16-sr") == pytest.approx(wanted, rel=0.15)


def _sgd_trainer(policy: str, seed: int = 0) -> tuple[gluon.Block, Trainer]:
    net = mlp()
    # lr a power of two and batch size 1: the float32 update w - lr * g rounds once, as in
    # the NumPy reference's float32 arithmetic
    return net, Trainer(net, "sgd", {"learning_rate": 2**-5}, policy=policy, seed=seed)


def _backward(net: gluon.Block, x: mx.nd.NDArray, y: mx.nd.NDArray) -> None:
    with autograd.record():
        loss = L2(net(x).astype("float32"), y).sum()
    loss.backward()


@pytest.mark.parametrize("policy", STRATEGIES)
def test_each_step_is_the_numpy_references_arithmetic(policy: str) -> None:
    net, trainer = _sgd_trainer(policy, seed=7)
    x, y = batch(n=1)
    rng = np.random.Generator(np.random.PCG64(7))  # the reference's stream, same seed
    assert trainer.masters is not None
    # the net's order ("0.weight", "0.bias"...), which the rounding's draws follow
    pairs = [(p, trainer.masters.master_for(p)) for p in net._collect_params_with_prefix().values()]
    for _ in range(5):
        _backward(net, x, y)
        trainer.allreduce_grads()
        best = [m.data().asnumpy() for _, m in pairs]
        grads = [m.grad().asnumpy() for _, m in pairs]
        trainer.update(1)
        for (model, master), before, grad in zip(pairs, best, grads, strict=True):
            updated = (before - np.float32(2**-5) * grad).astype(np.float32)
            if policy == "O3-bf16-kahan":
                weight, comp = reference.kahan_split(updated)
                expected_best = weight + comp
            else:
                weight = reference.round_stochastic_to_bfloat16(updated, rng)
                expected_best = weight
            np.testing.assert_array_equal(model.data().astype("float32").asnumpy(), weight)
            np.testing.assert_array_equal(master.data().asnumpy(), expected_best)


def _train(net: gluon.Block, trainer: Trainer, steps: int, n: int = 8) -> list[float]:
    x, y = batch(n=n)
    losses = []
    for _ in range(steps):
        with autograd.record():
            loss = L2(net(x).astype("float32"), y)
        loss.backward()
        trainer.step(n)
        losses.append(float(loss.mean().asscalar()))
    return losses


OPTIMIZERS: dict[str, tuple[str, dict[str, float]]] = {
    "sgd-momentum": ("sgd", {"learning_rate": 0.05, "momentum": 0.9}),
    "adam": ("adam", {"learning_rate": 1e-3}),
    "adamw": ("adamw", {"learning_rate": 1e-3}),
}


@pytest.mark.parametrize("policy", STRATEGIES)
@pytest.mark.parametrize("optimizer", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_resume_repeats_the_trajectory_bit_for_bit(
    policy: str, optimizer: tuple[str, dict[str, float]], tmp_path: Path
) -> None:
    name, params = optimizer
    net = mlp()
    trainer = Trainer(net, name, dict(params), policy=policy, seed=3)
    _train(net, trainer, 4)
    net.save_parameters(str(tmp_path / "net.params"))
    trainer.save_states(str(tmp_path / "trainer.states"))
    _train(net, trainer, 4)

    other = mlp(seed=11)  # other weights and another seed: the checkpoint decides
    other_trainer = Trainer(other, name, dict(params), policy=policy, seed=99)
    other.load_parameters(str(tmp_path / "net.params"))
    other_trainer.load_states(str(tmp_path / "trainer.states"))
    _train(other, other_trainer, 4)
    for key, value in values(net).items():
        np.testing.assert_array_equal(values(other)[key], value, err_msg=key)
    for a, b in zip(trainer.master_params(), other_trainer.master_params(), strict=True):
        np.testing.assert_array_equal(a.data().asnumpy(), b.data().asnumpy())


def test_stochastic_rounding_repeats_with_its_seed_and_changes_with_another() -> None:
    def run(seed: int) -> dict[str, np.ndarray]:
        net = mlp()
        _train(net, Trainer(net, "sgd", {"learning_rate": 0.01}, policy="O3-bf16-sr", seed=seed), 5)
        return values(net)

    first, again, other = run(1), run(1), run(2)
    for key, value in first.items():
        np.testing.assert_array_equal(again[key], value)
    assert any(not np.array_equal(other[k], v) for k, v in first.items())


def test_saved_weights_are_weight_plus_compensation(tmp_path: Path) -> None:
    net = mlp()
    initial = {k: v.copy() for k, v in values(net).items()}
    trainer = Trainer(net, "sgd", {"learning_rate": 0.0}, policy="O3-bf16-kahan")
    path = str(tmp_path / "net.params")
    trainer.save_parameters(path)
    saved = {k: v.asnumpy() for k, v in mx.nd.load(path).items()}
    for key, value in initial.items():
        assert saved[key].dtype == np.float32
        # the compensation keeps what bfloat16 drops of the initial float32 weights
        np.testing.assert_allclose(saved[key], value, rtol=2**-15, atol=0)
        rounded = values(net)[key]
        np.testing.assert_array_equal(reference.round_to_bfloat16(saved[key]), rounded)
        if key.endswith("weight"):  # the biases start at 0.0, which bfloat16 holds
            assert not np.array_equal(saved[key], rounded), key


def test_a_plain_float32_file_loads_into_a_compensated_net(tmp_path: Path) -> None:
    plain = mlp(seed=4)
    path = str(tmp_path / "plain.params")
    plain.save_parameters(path)
    net = mlp()
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O3-bf16-kahan")
    net.load_parameters(path)
    loaded = master_values(trainer, net)
    for key, value in values(plain).items():
        np.testing.assert_allclose(loaded[key], value, rtol=2**-15, atol=0)


def _loss_after(policy: str, steps: int) -> float:
    """A student fitting a fixed linear teacher with a small learning rate: late updates are
    far below half a bfloat16 step of the weights."""
    rng = np.random.RandomState(0)
    inputs = rng.randn(64, 16).astype("float32")
    x, y = array(inputs), array(inputs @ rng.randn(16, 4).astype("float32"))
    mx.random.seed(0)
    net = gluon.nn.Dense(4, in_units=16, use_bias=False)
    net.initialize(mx.init.Normal(1.0))
    trainer = Trainer(net, "sgd", {"learning_rate": 5e-3}, policy=policy)
    for _ in range(steps):
        with autograd.record():
            loss = L2(net(x).astype("float32"), y)
        loss.backward()
        trainer.step(64)
    return float(L2(net(x).astype("float32"), y).mean().asscalar())


@pytest.mark.slow
def test_kahan_reaches_float32s_loss_where_plain_bfloat16_stalls() -> None:
    fp32, plain, kahan = (_loss_after(p, 600) for p in ("O0", "O3-bf16", "O3-bf16-kahan"))
    assert kahan == pytest.approx(fp32, rel=0.02)  # measured: 2.846 against 2.836
    assert plain > 3 * kahan  # measured: 9.98


@pytest.mark.parametrize("policy", STRATEGIES)
def test_replicas_on_two_contexts_stay_equal(policy: str) -> None:
    contexts = [mx.cpu(0), mx.cpu(1)]
    net = mlp(ctx=contexts)
    trainer = Trainer(net, "adam", {"learning_rate": 1e-3}, policy=policy, kvstore="device")
    train_replicas(net, trainer, contexts)
    for key, value in values(net, contexts[0]).items():
        np.testing.assert_array_equal(values(net, contexts[1])[key], value, err_msg=key)


def test_dtype_report_names_the_strategy_beside_the_islands() -> None:
    net = mlp()
    Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O3-bf16-kahan")
    report = dtype_report(net)
    for line in report.splitlines()[2:]:
        assert "bfloat16" in line and "master=kahan" in line, line


REFUSALS: dict[str, tuple[Callable[[], object], type[Exception], str]] = {
    "float16 params": (
        lambda: Trainer(mlp(), "sgd", policy="O3-bf16-kahan", param="float16"),
        PolicyError,
        "O3-bf16-kahan",
    ),
    "float16 preset": (
        lambda: Trainer(mlp(), "sgd", policy="O3", master="stochastic"),
        PolicyError,
        "O3-bf16-sr",
    ),
    "bfloat16 optimizer state without a strategy": (
        lambda: Trainer(mlp(), "adam", policy="O2-bf16,state=bfloat16"),
        PolicyError,
        "'O3-bf16-kahan,state=bfloat16'",
    ),
    "bad seed": (
        lambda: Trainer(mlp(), "sgd", policy="O3-bf16-sr", seed=-1),
        WrapError,
        "seed=0",
    ),
}


@pytest.mark.parametrize("make, error, fix", REFUSALS.values(), ids=REFUSALS.keys())
def test_bad_combinations_are_refused_naming_the_fix(
    make: Callable[[], object], error: type[Exception], fix: str
) -> None:
    with pytest.raises(error, match=fix):
        make()


def test_refused_strategy_leaves_the_net_as_it_was() -> None:
    net = mlp()
    with pytest.raises(PolicyError):
        Trainer(net, "sgd", policy="O3-bf16-kahan", param="float16")
    assert {np.dtype(p.dtype) for p in net.collect_params().values()} == {np.dtype(np.float32)}
    Trainer(net, "sgd", policy="O3-bf16-kahan")  # still free to be trained


def test_refused_bfloat16_state_leaves_the_net_as_it_was() -> None:
    net = mlp()
    with pytest.raises(PolicyError, match="compensated strategies"):
        Trainer(net, "adam", policy="O3-bf16", state="bfloat16")
    assert {np.dtype(p.dtype) for p in net.collect_params().values()} == {np.dtype(np.float32)}
    Trainer(net, "adam", policy="O3-bf16-sr", state="bfloat16")  # still free to be trained


def test_states_without_the_compensation_are_refused_before_anything_changes(
    tmp_path: Path,
) -> None:
    net = mlp()
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1, "momentum": 0.9}, policy="O3-bf16-kahan")
    _train(net, trainer, 2)
    path = str(tmp_path / "trainer.states")
    trainer.save_states(path)
    rewrite_states(path, lambda header, arrays: header.pop("compensation"))
    before, scale = values(net), trainer.loss_scale
    best = [m.data().asnumpy() for m in trainer.master_params()]
    with pytest.raises(CheckpointError, match="master=kahan"):
        trainer.load_states(path)
    for key, value in before.items():
        np.testing.assert_array_equal(values(net)[key], value)
    for master, value in zip(trainer.master_params(), best, strict=True):
        np.testing.assert_array_equal(master.data().asnumpy(), value)
    assert trainer.loss_scale == scale
    assert os.path.exists(path)


def test_states_of_the_other_strategy_are_refused(tmp_path: Path) -> None:
    sr_net = mlp()
    sr = Trainer(sr_net, "sgd", {"learning_rate": 0.1}, policy="O3-bf16-sr")
    _train(sr_net, sr, 1)
    path = str(tmp_path / "sr.states")
    sr.save_states(path)
    kahan = Trainer(mlp(), "sgd", {"learning_rate": 0.1}, policy="O3-bf16-kahan")
    with pytest.raises(CheckpointError, match="O3-bf16-sr"):
        kahan.load_states(path)


def _named_mlp(first: str, second: str) -> gluon.HybridSequential:
    """:func:`mlp` with chosen Gluon prefixes, so that two copies can sort their parameters
    (as ``gluon.Trainer`` numbers them) in different orders."""
    mx.random.seed(0)
    net = gluon.nn.HybridSequential(prefix="net_")
    with net.name_scope():
        net.add(gluon.nn.Dense(16, in_units=8, activation="relu", prefix=first))
        net.add(gluon.nn.Dense(4, in_units=16, prefix=second))
    net.initialize(mx.init.Xavier())
    return net


@pytest.mark.parametrize("policy", ["O2-bf16", "O3-bf16-sr", "O3-bf16-kahan"])
def test_states_follow_the_parameters_when_gluon_numbers_them_differently(
    policy: str, tmp_path: Path
) -> None:
    net = _named_mlp("a_", "b_")
    trainer = Trainer(net, "adam", {"learning_rate": 1e-2}, policy=policy, seed=1)
    _train(net, trainer, 3)
    net.save_parameters(str(tmp_path / "net.params"))
    trainer.save_states(str(tmp_path / "trainer.states"))
    _train(net, trainer, 3)

    other = _named_mlp("b_", "a_")  # the first layer's parameters now sort last
    other_trainer = Trainer(other, "adam", {"learning_rate": 1e-2}, policy=policy, seed=1)
    assert [p.shape for p in other_trainer._params] != [p.shape for p in trainer._params]
    other.load_parameters(str(tmp_path / "net.params"))
    other_trainer.load_states(str(tmp_path / "trainer.states"))
    _train(other, other_trainer, 3)
    for key, value in values(net).items():
        np.testing.assert_array_equal(values(other)[key], value, err_msg=key)


@pytest.mark.parametrize("policy", ["O3-bf16", *STRATEGIES])
def test_deferred_shapes_set_up_inside_the_first_recorded_forward(policy: str) -> None:
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(8, activation="relu"), gluon.nn.Dense(2))  # no in_units
    net.initialize()
    net.hybridize()
    trainer = Trainer(net, "adam", {"learning_rate": 1e-2}, policy=policy)
    x, y = mx.nd.ones((4, 3)), mx.nd.ones((4, 2))
    losses = []
    for _ in range(3):
        with autograd.record():  # the Trainer sets up its masters in here, on the first pass
            loss = L2(net(x).astype("float32"), y)
        loss.backward()
        trainer.step(4)
        losses.append(float(loss.mean().asscalar()))
    assert losses[-1] < losses[0]
