"""The Gluon step on MXNet's multi-tensor kernels (issue 34) against the per-parameter path.

``MIXPREC_MXNET_MULTI_TENSOR=0`` keeps the per-parameter path (one ``dot``, one ``amp_cast``
each way and, for AdamW, one ``adamw_update`` per parameter; Gluon's updater for the rest).
SGD, SGD momentum and LAMB give the same weights bit for bit (the same kernels, in larger
chunks); AdamW to float32 rounding (the multi kernel rounds the moment update differently);
Adam runs per parameter on both paths (MXNet has no multi-tensor Adam), so bit for bit too.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

from _mx_nets import array, batch, cnn, mlp  # noqa: E402
from mxnet import autograd, gluon, nd  # noqa: E402

import mixprec.mxnet  # noqa: E402
from mixprec_mxnet import Trainer  # noqa: E402
from mixprec_mxnet.dtypes import cast  # noqa: E402
from mixprec_mxnet.step import multi_tensor  # noqa: E402

pytestmark = pytest.mark.mxnet

L2 = gluon.loss.L2Loss()
SCE = gluon.loss.SoftmaxCrossEntropyLoss()
OPTIMIZERS: dict[str, tuple[str, dict[str, Any], bool]] = {
    # name: (optimizer, params, bitwise)
    "sgd": ("sgd", {"learning_rate": 0.1, "wd": 1e-3}, True),
    "momentum": ("sgd", {"learning_rate": 0.05, "momentum": 0.9, "wd": 1e-3}, True),
    "adam": ("adam", {"learning_rate": 1e-2, "wd": 1e-3}, True),
    "adamw": ("adamw", {"learning_rate": 1e-2, "wd": 1e-2}, False),
    "lamb": ("lamb", {"learning_rate": 1e-2, "wd": 1e-3}, True),
}


def _weights(net: Any, trainer: Any) -> list[np.ndarray]:
    """The masters, then the model weights, in float32, in the net's order (the trainer's
    sorts by global names, which differ between two copies of a net)."""
    params = list(net.collect_params().values())
    out = [trainer.masters.master_for(p).data().asnumpy() for p in params]
    out += [cast(p.data(), "float32").asnumpy() for p in params]
    return out


def _train(
    monkeypatch: pytest.MonkeyPatch,
    multi: bool,
    name: str,
    policy: str = "O2-bf16",
    steps: int = 4,
    inf_at: int | None = None,
    clip: float | None = None,
    accumulate: bool = False,
    image: bool = False,
) -> tuple[list[list[np.ndarray]], Any]:
    monkeypatch.setenv(multi_tensor.ENV, "1" if multi else "0")
    optimizer, params, _ = OPTIMIZERS[name]
    net = cnn() if image else mlp()
    kwargs = {"loss_scale": "dynamic"} if clip is not None else {}
    # a few parameters learn at their own rate and decay: per-array lrs and wds
    first = next(iter(net.collect_params().values()))
    first.lr_mult, first.wd_mult = 0.5, 2.0
    trainer = Trainer(net, optimizer, dict(params), policy=policy, **kwargs)
    if accumulate:
        net.collect_params().setattr("grad_req", "add")
    loss_fn = SCE if image else L2
    history = [_weights(net, trainer)]
    for step in range(steps):
        micro = 2 if accumulate else 1
        for part in range(micro):
            x, y = batch(n=8, seed=step * 2 + part, image=image)
            factor = math.inf if step == inf_at else 1.0
            with autograd.record():
                loss = loss_fn(net(x), y) * factor
            with trainer.scale_loss(loss) as scaled:
                scaled.backward()
        if clip is not None:
            mixprec.mxnet.clip_global_norm(trainer, clip)
        trainer.step(8 * micro)
        if accumulate:
            net.collect_params().zero_grad()
        history.append(_weights(net, trainer))
    return history, trainer


def _same(
    a: list[list[np.ndarray]], b: list[list[np.ndarray]], bitwise: bool, atol: float = 1e-6
) -> None:
    assert len(a) == len(b)
    for step, (wa, wb) in enumerate(zip(a, b, strict=True)):
        masters = len(wa) // 2
        for i, (x, y) in enumerate(zip(wa, wb, strict=True)):
            if bitwise:
                np.testing.assert_array_equal(x, y, err_msg=f"step {step}")
            elif i < masters:  # float32 rounding of the moments, a few steps on: a few ulps
                np.testing.assert_allclose(x, y, rtol=2e-5, atol=atol, err_msg=f"step {step}")
            else:  # the bfloat16 weights: a master next to a rounding boundary may go either way
                np.testing.assert_allclose(x, y, rtol=2**-7, atol=atol, err_msg=f"step {step}")


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_same_weights_as_the_per_parameter_path(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    per_param, _ = _train(monkeypatch, False, name)
    multi, _ = _train(monkeypatch, True, name)
    _same(per_param, multi, OPTIMIZERS[name][2])
    assert not np.array_equal(multi[0][0], multi[-1][0])  # it trained


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adamw"])
def test_a_skipped_step_changes_nothing_on_either_path(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    per_param, t0 = _train(monkeypatch, False, name, inf_at=1)
    multi, t1 = _train(monkeypatch, True, name, inf_at=1)
    _same(per_param, multi, OPTIMIZERS[name][2])
    for x, y in zip(multi[1], multi[2], strict=True):  # step 1 skipped: nothing moved
        np.testing.assert_array_equal(x, y)
    assert t0.scaler.skipped_steps == t1.scaler.skipped_steps == 1


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adamw"])
def test_clipping_gives_the_same_weights(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    per_param, _ = _train(monkeypatch, False, name, clip=0.5)
    multi, _ = _train(monkeypatch, True, name, clip=0.5)
    _same(per_param, multi, OPTIMIZERS[name][2])


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adamw"])
def test_accumulation_gives_the_same_weights(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    per_param, _ = _train(monkeypatch, False, name, accumulate=True, steps=3)
    multi, _ = _train(monkeypatch, True, name, accumulate=True, steps=3)
    _same(per_param, multi, OPTIMIZERS[name][2])


@pytest.mark.parametrize("policy", ["O3-bf16", "O3-bf16-kahan", "O3-bf16-sr", "O0"])
def test_other_policies_give_the_same_weights(monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    per_param, _ = _train(monkeypatch, False, "momentum", policy=policy, image=True, steps=3)
    multi, _ = _train(monkeypatch, True, "momentum", policy=policy, image=True, steps=3)
    _same(per_param, multi, True)


def test_the_overflow_check_decides_as_the_per_parameter_one() -> None:
    from mixprec_mxnet.step.protocol import count_nonfinite

    rng = np.random.default_rng(0)
    finite = [array(rng.standard_normal((5, 3))) for _ in range(4)]
    big = [array(np.full((4,), 1.5e19)) for _ in range(4)]  # each square finite, the sum not
    cases = {
        "finite": finite,
        "inf": [*finite, array([1.0, math.inf])],
        "nan": [array([math.nan]), *finite],
        "sum overflows": big,
        "one bfloat16": [*finite, cast(finite[0], "bfloat16")],
        # at least DOT_FROM elements: a dot of its own beside the multi_sum_sq of the rest
        "large finite": [*finite, array(rng.standard_normal(multi_tensor.DOT_FROM))],
        "large inf": [*finite, array(np.full(multi_tensor.DOT_FROM, math.inf))],
        "large and small sum overflows": [array(np.full(multi_tensor.DOT_FROM, 1e17)), *big],
    }
    for label, arrays in cases.items():
        mine = int(multi_tensor.count_nonfinite(arrays).asscalar())
        theirs = int(count_nonfinite(arrays).asscalar())
        assert mine == theirs, label
    assert int(multi_tensor.count_nonfinite(big).asscalar()) == 1


def test_batched_casts_round_as_amp_cast() -> None:
    rng = np.random.default_rng(1)
    sources = [array(rng.standard_normal((7, 3)) * 10.0 ** rng.integers(-8, 8)) for _ in range(5)]
    targets = [cast(nd.zeros(s.shape), "bfloat16") for s in sources]
    multi_tensor.cast_pairs(list(zip(sources, targets, strict=True)))
    for s, t in zip(sources, targets, strict=True):
        assert t.dtype == cast(s, "bfloat16").dtype
        expected = cast(cast(s, "bfloat16"), "float32").asnumpy()
        np.testing.assert_array_equal(cast(t, "float32").asnumpy(), expected)
    back = [nd.zeros(s.shape) for s in sources]
    multi_tensor.cast_pairs(list(zip(targets, back, strict=True)))
    for t, b in zip(targets, back, strict=True):
        np.testing.assert_array_equal(b.asnumpy(), cast(t, "float32").asnumpy())


def test_many_parameters_go_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """More arrays than one kernel call takes (60 SGD, 50 AdamW, 45 LAMB)."""

    def deep() -> Any:
        mx.random.seed(0)
        net = gluon.nn.HybridSequential()
        for _ in range(40):  # 80 parameters
            net.add(gluon.nn.Dense(8, in_units=8))
        net.initialize(mx.init.Xavier())
        return net

    results = []
    for multi in (False, True):
        monkeypatch.setenv(multi_tensor.ENV, "1" if multi else "0")
        finals = []
        for optimizer in ("sgd", "lamb", "adamw"):
            net = deep()
            params = {"learning_rate": 0.01, "momentum": 0.9} if optimizer == "sgd" else {}
            trainer = Trainer(net, optimizer, params, policy="O2-bf16")
            for step in range(2):
                x, y = batch(n=8, seed=step)
                with autograd.record():
                    loss = L2(net(x), y[:, :1].broadcast_to((8, 8)))
                loss.backward()
                trainer.step(8)
            finals.append(_weights(net, trainer))
        results.append(finals)
    for i, bitwise in enumerate((True, True, False)):
        # AdamW: 40 bfloat16 layers carry a weight's rounding flip into the next step's
        # gradients; with lr 1e-3 the masters still agree to 1 % of a step
        _same([results[0][i]], [results[1][i]], bitwise, atol=1e-5)


def test_fewer_ops_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted by MXNet's profiler: the multi-tensor step runs fewer ops than the
    per-parameter one (the figures are in docs/benchmarks.md)."""
    from benchmarks.mxnet_step import ops_per_step

    before = ops_per_step("tiny", "adamw", multi=False)
    after = ops_per_step("tiny", "adamw", multi=True)
    assert sum(after.values()) < sum(before.values())
    assert after.get("dot", 0) == 0 and after.get("amp_multicast", 0) >= 1
