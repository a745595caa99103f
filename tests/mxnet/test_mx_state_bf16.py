"""``state=bfloat16`` on Gluon, under ``master=kahan`` and ``master=stochastic``: the optimizer
state of the compensated parameters held as bfloat16 NDArrays between steps, widened into
float32 for MXNet's update and rounded back stochastically with the strategy's generator in
the NumPy reference's order; skipped steps, checkpoints and the refusals."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")
reference = pytest.importorskip("mixprec_numpy.compensation")

from _mx_nets import batch, cnn, mlp, train_replicas, values  # noqa: E402
from mxnet import autograd, gluon, nd  # noqa: E402

from mixprec.errors import PolicyError  # noqa: E402
from mixprec_mxnet import Trainer  # noqa: E402
from mixprec_mxnet.clipping import clip_global_norm  # noqa: E402
from mixprec_mxnet.dtypes import BFLOAT16_NP, cast  # noqa: E402
from mixprec_mxnet.lowbit.state import LowBitArray, state_bytes  # noqa: E402
from mixprec_numpy.layers import Parameter  # noqa: E402
from mixprec_numpy.optimizer import SGD  # noqa: E402

pytestmark = pytest.mark.mxnet

POLICIES = {"kahan": "O3-bf16-kahan,state=bfloat16", "sr": "O3-bf16-sr,state=bfloat16"}
STRATEGY = {"kahan": "kahan", "sr": "stochastic"}
OPTIMIZERS: dict[str, tuple[str, dict[str, float]]] = {
    "adam": ("adam", {"learning_rate": 1e-3}),
    "adamw": ("adamw", {"learning_rate": 1e-3}),
    "sgd-momentum": ("sgd", {"learning_rate": 0.05, "momentum": 0.9}),
}
L2 = gluon.loss.L2Loss()


@pytest.fixture(autouse=True)
def _own_block_names() -> Iterator[None]:
    """Name this file's blocks from a counter of its own (see test_compensated.py)."""
    with mx.name.NameManager():
        yield


def _named(net: gluon.Block) -> dict[str, gluon.Parameter]:
    """The net's parameters in the net's order (the order the noise is drawn in)."""
    return dict(net._collect_params_with_prefix())


def _state(trainer: Trainer, param: gluon.Parameter) -> list[nd.NDArray]:
    state = trainer._updaters[0].states[trainer._param2idx[param.name]]
    return list(state) if isinstance(state, (tuple, list)) else [state]


def _f32(array: nd.NDArray) -> np.ndarray:
    return cast(array, "float32").asnumpy()


def _comps(trainer: Trainer, net: gluon.Block) -> dict[str, np.ndarray]:
    names = {id(p): n for n, p in _named(net).items()}
    comp = trainer._mixprec.compensation
    assert comp is not None
    return dict(comp.state_dict(names)["compensation"])


def _backward(net: gluon.Block, x: nd.NDArray, y: nd.NDArray, scale: float = 1.0) -> None:
    with autograd.record():
        loss = L2(net(x).astype("float32"), y).sum() * scale
    loss.backward()


def _train(net: gluon.Block, trainer: Trainer, steps: int, n: int = 8) -> None:
    x, y = batch(n=n)
    for _ in range(steps):
        _backward(net, x, y)
        trainer.step(n)


def _bits(trainer: Trainer, net: gluon.Block) -> dict[str, np.ndarray]:
    """Weights, compensation and every optimizer state array, as raw bits, by name."""
    out = {f"w/{k}": v.view(np.uint32) for k, v in values(net).items()}
    if trainer._mixprec.compensation is not None:
        out.update({f"c/{k}": v.view(np.uint32) for k, v in _comps(trainer, net).items()})
    for name, param in _named(net).items():
        for j, array in enumerate(_state(trainer, param)):
            out[f"s/{name}/{j}/{np.dtype(array.dtype)}"] = array.asnumpy().copy()
    return out


def _assert_same_bits(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        np.testing.assert_array_equal(value, b[key], err_msg=key)


# ---------------------------------------------------------------------- against the reference


def _reference(
    trainer: Trainer, net: gluon.Block, strategy: str, seed: int, state: str | None
) -> tuple[list[Parameter], Any]:
    """The NumPy reference's parameters and Compensation, from the Trainer's start: the
    same bfloat16 weights and (kahan) the same initial compensation."""
    params = [Parameter(n, _f32(p.data()), "bfloat16") for n, p in _named(net).items()]
    ref = reference.Compensation(params, STRATEGY[strategy], seed=seed, state=state)
    if strategy == "kahan":
        ref.buffers = {k: v.copy() for k, v in _comps(trainer, net).items()}
    return params, ref


def _grads(trainer: Trainer, net: gluon.Block, params: list[Parameter], how: str) -> None:
    """Reduce (and clip) the Trainer's gradients; hand the float32 master gradients the
    update will read to the reference parameters."""
    trainer.allreduce_grads()
    if how == "clipped":
        clip_global_norm(trainer, 0.05)
    assert trainer.masters is not None
    for ref, param in zip(params, _named(net).values(), strict=True):
        ref.grad = trainer.masters.master_for(param).grad().asnumpy().copy()


def _backwards(net: gluon.Block, trainer: Trainer, how: str, step: int) -> None:
    if how != "accumulated":
        x, y = batch(n=1, seed=step)
        _backward(net, x, y)
        return
    for seed in (step, 100 + step):  # grad_req='add': two micro-batches summed in float32
        x, y = batch(n=1, seed=seed)
        with autograd.record():
            loss = L2(net(x).astype("float32"), y).sum()
            with trainer.scale_loss(loss) as scaled:
                autograd.backward(scaled)


def _compare(
    trainer: Trainer, net: gluon.Block, strategy: str, params: list[Parameter], ref: Any
) -> None:
    for p, (name, model) in zip(params, _named(net).items(), strict=True):
        np.testing.assert_array_equal(_f32(model.data()), p.data, err_msg=name)
        if strategy == "kahan":
            np.testing.assert_array_equal(_comps(trainer, net)[name], ref.buffers[name])


@pytest.mark.parametrize("how", ["plain", "per-parameter", "clipped", "accumulated"])
@pytest.mark.parametrize("strategy", POLICIES)
def test_sgd_momentum_is_the_numpy_references_arithmetic_bit_for_bit(
    strategy: str, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reference's Compensation(state="bfloat16") around its SGD with momentum. MXNet
    keeps the momentum as ``-lr * v`` where the reference keeps ``v``: with lr a power of
    two both are the same float32 numbers scaled, and stochastic rounding with the same
    noise commutes with that scaling, so the bits agree exactly. ``per-parameter``: Gluon's
    updater instead of the multi-tensor kernels."""
    if how == "per-parameter":
        monkeypatch.setenv("MIXPREC_MXNET_MULTI_TENSOR", "0")
    lr = 2.0**-5
    net = mlp()
    if how == "accumulated":
        net.collect_params().setattr("grad_req", "add")
    trainer = Trainer(
        net, "sgd", {"learning_rate": lr, "momentum": 0.9}, policy=POLICIES[strategy], seed=7
    )
    params, ref = _reference(trainer, net, strategy, 7, "bfloat16")
    sgd = SGD(lr=lr, momentum=0.9)
    for step in range(6):
        _backwards(net, trainer, how, step)
        _grads(trainer, net, params, how)
        trainer.update(1)
        ref.update(sgd, params)
        if how == "accumulated":
            net.collect_params().zero_grad()
        _compare(trainer, net, strategy, params, ref)
        for p, model in zip(params, _named(net).values(), strict=True):
            (mom,) = _state(trainer, model)
            assert np.dtype(mom.dtype) == BFLOAT16_NP, p.name
            np.testing.assert_array_equal(_f32(mom), -np.float32(lr) * sgd.state[p.name], p.name)
    assert ref.rng.bit_generator.state == trainer._mixprec.compensation.rng.bit_generator.state


class _MXNetAdam:
    """MXNet 1.9's ``adam_update`` in NumPy float32, for the reference's Compensation:
    ``g = grad * rescale``; ``m = b1 m + (1 - b1) g``; ``v = b2 v + (1 - b2) g g``;
    ``w -= lr_t m / (sqrt(v) + eps)`` with ``lr_t = lr sqrt(1 - b2^t) / (1 - b1^t)``."""

    def __init__(self, lr: float, rescale: float) -> None:
        self.lr, self.rescale, self.t = lr, rescale, 0
        self.b1, self.b2, self.eps = 0.9, 0.999, 1e-8
        self.state: dict[str, np.ndarray] = {}  # nothing for round_state: see the test
        self.moments: dict[str, list[np.ndarray]] = {}

    def update(self, params: list[Parameter]) -> None:
        self.t += 1
        lr_t = np.float32(self.lr * math.sqrt(1.0 - self.b2**self.t) / (1.0 - self.b1**self.t))
        b1, b2, one = np.float32(self.b1), np.float32(self.b2), np.float32(1.0)
        for p in params:
            assert p.grad is not None
            g = (p.grad * np.float32(self.rescale)).astype(np.float32)
            m, v = self.moments.get(p.name, [np.zeros_like(g), np.zeros_like(g)])
            m = b1 * m + (one - b1) * g
            v = b2 * v + (one - b2) * g * g
            self.moments[p.name] = [m, v]
            p.data = p.data - lr_t * m / (np.sqrt(v) + np.float32(self.eps))


@pytest.mark.parametrize("strategy", POLICIES)
def test_adam_is_the_numpy_references_rounding_bit_for_bit(strategy: str) -> None:
    """MXNet's Adam arithmetic in NumPy float32, inside the reference's Compensation; then
    each parameter's mean and variance rounded with the reference's ``round_state`` from the
    same stream (after the weights; parameter by parameter, the mean before the variance)."""
    net = mlp()
    trainer = Trainer(net, "adam", {"learning_rate": 1e-3}, policy=POLICIES[strategy], seed=11)
    params, ref = _reference(trainer, net, strategy, 11, None)
    adam = _MXNetAdam(1e-3, rescale=1.0 / 4)
    for step in range(6):
        x, y = batch(n=4, seed=step)
        _backward(net, x, y)
        _grads(trainer, net, params, "plain")
        trainer.update(4)
        ref.update(adam, params)
        for p in params:  # state="bfloat16": after the weights, the same stream
            for position in range(2):
                held = {p.name: adam.moments[p.name][position]}
                reference.round_state(held, [p], ref.rng)
                adam.moments[p.name][position] = held[p.name]
        _compare(trainer, net, strategy, params, ref)
        for p, model in zip(params, _named(net).values(), strict=True):
            mean, var = _state(trainer, model)
            assert {np.dtype(mean.dtype), np.dtype(var.dtype)} == {BFLOAT16_NP}
            np.testing.assert_array_equal(_f32(mean), adam.moments[p.name][0], p.name)
            np.testing.assert_array_equal(_f32(var), adam.moments[p.name][1], p.name)
    assert ref.rng.bit_generator.state == trainer._mixprec.compensation.rng.bit_generator.state


# ---------------------------------------------------------------------- what is held


@pytest.mark.parametrize("strategy", POLICIES)
@pytest.mark.parametrize("optimizer", [*OPTIMIZERS, "nag", "lamb"])
def test_the_state_is_bfloat16_between_steps_at_half_the_bytes(
    strategy: str, optimizer: str
) -> None:
    name, options = OPTIMIZERS.get(optimizer, (optimizer, {"learning_rate": 0.01}))
    if optimizer == "nag":
        options = {"learning_rate": 0.01, "momentum": 0.9}
    held = {}
    for policy in (POLICIES[strategy].split(",")[0], POLICIES[strategy]):
        net = mlp()
        trainer = Trainer(net, name, options, policy=policy, seed=1)
        _train(net, trainer, 3)
        held[policy] = state_bytes(trainer._updaters[0].states)
    dtypes = {np.dtype(a.dtype) for p in _named(net).values() for a in _state(trainer, p)}
    assert dtypes == {BFLOAT16_NP}
    assert held[POLICIES[strategy]] * 2 == held[POLICIES[strategy].split(",")[0]]


def test_parameters_the_policy_keeps_in_float32_keep_float32_state() -> None:
    """BatchNorm's gamma and beta stay float32 under O3-bf16 (the strategy compensates only
    bfloat16 weights), and so does their state."""
    net = cnn()
    trainer = Trainer(net, "adam", {"learning_rate": 1e-3}, policy=POLICIES["sr"])
    x, y = batch(n=4, image=True)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for _ in range(2):
        with autograd.record():
            loss = loss_fn(net(x).astype("float32"), y)
        loss.backward()
        trainer.step(4)
    kinds = {}
    for name, param in _named(net).items():
        if param.grad_req == "null":
            continue
        kinds[name] = {np.dtype(a.dtype) for a in _state(trainer, param)}
        expected = BFLOAT16_NP if np.dtype(param.dtype) == BFLOAT16_NP else np.dtype(np.float32)
        assert kinds[name] == {expected}, name
    assert {np.dtype(np.float32)} in kinds.values() and {BFLOAT16_NP} in kinds.values()


@pytest.mark.parametrize("strategy", POLICIES)
def test_replicas_on_two_contexts_keep_equal_bfloat16_state(strategy: str) -> None:
    contexts = [mx.cpu(0), mx.cpu(1)]
    net = mlp(ctx=contexts)
    trainer = Trainer(net, "adam", {"learning_rate": 1e-3}, policy=POLICIES[strategy])
    train_replicas(net, trainer, contexts)
    first, second = trainer._updaters
    assert first.states.keys() == second.states.keys() and first.states
    for index, state in first.states.items():
        for a, b in zip(state, second.states[index], strict=True):
            assert np.dtype(a.dtype) == np.dtype(b.dtype) == BFLOAT16_NP
            assert (a.context, b.context) == (mx.cpu(0), mx.cpu(1))
            np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
    for key, value in values(net, contexts[0]).items():
        np.testing.assert_array_equal(values(net, contexts[1])[key], value, err_msg=key)


# ---------------------------------------------------------------------- skips


@pytest.mark.parametrize("strategy", POLICIES)
def test_a_skipped_step_leaves_everything_bit_for_bit_and_draws_no_noise(strategy: str) -> None:
    def run(skip: bool) -> tuple[Trainer, gluon.Block, dict[str, np.ndarray]]:
        net = mlp()
        trainer = Trainer(net, "adam", {"learning_rate": 1e-3}, policy=POLICIES[strategy])
        _train(net, trainer, 2)
        if skip:
            before = _bits(trainer, net)
            rng = dict(trainer._mixprec.compensation.rng.bit_generator.state)
            x, y = batch(n=8)
            _backward(net, x, y, scale=float("inf"))  # inf gradients: the step is skipped
            trainer.step(8)
            assert trainer.skipped_steps == 1
            _assert_same_bits(before, _bits(trainer, net))
            assert trainer._mixprec.compensation.rng.bit_generator.state == rng
        _train(net, trainer, 2)
        return trainer, net, _bits(trainer, net)

    _, _, skipped = run(True)
    _, _, straight = run(False)
    _assert_same_bits(skipped, straight)


# ---------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("strategy", POLICIES)
@pytest.mark.parametrize("optimizer", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_save_and_resume_repeat_the_trajectory_bit_for_bit(
    tmp_path: Path, strategy: str, optimizer: tuple[str, dict[str, float]]
) -> None:
    name, options = optimizer
    net = mlp()
    trainer = Trainer(net, name, options, policy=POLICIES[strategy], seed=3)
    _train(net, trainer, 3)
    params, states = str(tmp_path / "net.params"), str(tmp_path / "trainer.states")
    net.save_parameters(params)
    trainer.save_states(states)
    saved = nd.load(states)  # the file holds the bfloat16 state as kept
    kinds = {np.dtype(a.dtype) for k, a in saved.items() if k.startswith("optimizer/")}
    assert kinds == {BFLOAT16_NP}
    _train(net, trainer, 3)

    other = mlp(seed=1)
    resumed = Trainer(other, name, options, policy=POLICIES[strategy], seed=99)
    other.load_parameters(params)
    resumed.load_states(states)
    _train(other, resumed, 3)
    _assert_same_bits(_bits(trainer, net), _bits(resumed, other))


@pytest.mark.parametrize("strategy", POLICIES)
def test_a_float32_states_file_loads_rounded_to_nearest_and_back(
    tmp_path: Path, strategy: str
) -> None:
    """A file saved without state=bfloat16 loads with its state rounded to the nearest
    bfloat16 value (no noise drawn); a bfloat16 file loads into a Trainer without the item
    widened exactly, and into a low-bit Trainer as codes."""
    plain = POLICIES[strategy].split(",")[0]
    net = mlp()
    trainer = Trainer(net, "adam", {"learning_rate": 1e-3}, policy=plain, seed=3)
    _train(net, trainer, 3)
    path = str(tmp_path / "float32.states")
    trainer.save_states(path)
    float32_state = {n: [_f32(a) for a in _state(trainer, p)] for n, p in _named(net).items()}
    rng = dict(trainer._mixprec.compensation.rng.bit_generator.state)

    bf16 = Trainer(mlp(), "adam", {"learning_rate": 1e-3}, policy=POLICIES[strategy], seed=3)
    bf16.load_states(path)
    assert bf16._mixprec.compensation.rng.bit_generator.state == rng  # no noise drawn
    for name, param in _named(bf16._mixprec.net).items():
        for j, array in enumerate(_state(bf16, param)):
            assert np.dtype(array.dtype) == BFLOAT16_NP
            nearest = reference.round_to_bfloat16(float32_state[name][j])
            np.testing.assert_array_equal(_f32(array), nearest, f"{name} {j}")
    assert any(
        not np.array_equal(reference.round_to_bfloat16(s), s)
        for states in float32_state.values()
        for s in states
    ), "the float32 state was on the bfloat16 grid already: the test shows nothing"

    back = str(tmp_path / "bfloat16.states")
    bf16.save_states(back)
    kept = {n: [_f32(a) for a in _state(bf16, p)] for n, p in _named(bf16._mixprec.net).items()}
    wide = Trainer(mlp(), "adam", {"learning_rate": 1e-3}, policy=plain, seed=3)
    wide.load_states(back)
    for name, param in _named(wide._mixprec.net).items():
        for j, array in enumerate(_state(wide, param)):
            assert np.dtype(array.dtype) == np.dtype(np.float32)
            np.testing.assert_array_equal(array.asnumpy(), kept[name][j])
    codes = Trainer(
        mlp(), "adam", {"learning_rate": 1e-3}, policy=f"{plain},state=int8(min_size=0)"
    )
    codes.load_states(back)
    assert all(
        isinstance(a, LowBitArray)
        for p in _named(codes._mixprec.net).values()
        for a in _state(codes, p)
    )
    coded = str(tmp_path / "int8.states")  # and codes into bfloat16: decoded, then nearest
    codes.save_states(coded)
    decoded = {
        n: [a.numpy() for a in _state(codes, p)] for n, p in _named(codes._mixprec.net).items()
    }
    again = Trainer(mlp(), "adam", {"learning_rate": 1e-3}, policy=POLICIES[strategy], seed=3)
    again.load_states(coded)
    for name, param in _named(again._mixprec.net).items():
        for j, array in enumerate(_state(again, param)):
            assert np.dtype(array.dtype) == BFLOAT16_NP
            nearest = reference.round_to_bfloat16(decoded[name][j])
            np.testing.assert_array_equal(_f32(array), nearest, f"{name} {j}")


# ---------------------------------------------------------------------- refusals


@pytest.mark.parametrize("policy", ["O2-bf16,state=bfloat16", "O3-bf16,state=bfloat16"])
def test_bfloat16_state_without_a_strategy_is_refused_naming_what_works(policy: str) -> None:
    net = mlp()
    with pytest.raises(PolicyError, match=r"'O3-bf16-kahan,state=bfloat16'") as refused:
        Trainer(net, "adam", policy=policy)
    assert "'O3-bf16-sr,state=bfloat16'" in str(refused.value)
    assert {np.dtype(p.dtype) for p in net.collect_params().values()} == {np.dtype(np.float32)}
    for works in POLICIES.values():  # what the refusal names trains on Gluon
        trainer = Trainer(net, "adam", {"learning_rate": 1e-3}, policy=works)
        _train(net, trainer, 1)
        net = mlp()


def test_the_conformance_adapter_declares_bfloat16_state() -> None:
    from mixprec_mxnet.conformance import MXNetAdapter

    assert "bfloat16" in MXNetAdapter.state_dtypes
