"""float32 <-> bfloat16 on the CPU with ``Cast`` and float32 ops, held to ``amp_cast``'s bits
(:mod:`mixprec_mxnet.bf16_rounding`, used by the step's master copies for large arrays:
:func:`mixprec_mxnet.step.multi_tensor.cast_pairs`)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

from mxnet import autograd, gluon, nd  # noqa: E402

from mixprec_mxnet import Trainer  # noqa: E402
from mixprec_mxnet.bf16_rounding import from_bf16_into, splittable, to_bf16_into  # noqa: E402
from mixprec_mxnet.dtypes import BFLOAT16_NP  # noqa: E402
from mixprec_mxnet.step import multi_tensor  # noqa: E402

pytestmark = pytest.mark.mxnet

LOWS = np.array([0, 1, 0x4000, 0x7FFF, 0x8000, 0x8001, 0xC000, 0xFFFF], np.uint32)


def _every_interval() -> np.ndarray:
    """Each of the 65536 bfloat16 intervals' edges and middle: ties, one off each side."""
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    return (high[:, None] | LOWS[None, :]).ravel().view(np.float32)


def _amp_cast(values: nd.NDArray) -> np.ndarray:
    return nd.amp_cast(values, dtype=BFLOAT16_NP).asnumpy().view(np.uint16)


def test_to_bf16_has_amp_casts_bits_below_the_splittings_bound() -> None:
    x = _every_interval()
    x = x[np.isfinite(x) & (np.abs(x) < np.float32(3.4028235e38) / np.float32(65537))]
    x = x[x.view(np.uint32) != 0x80000000]  # -0: amp_cast writes +0, the ops keep -0
    out = nd.zeros(x.shape, dtype=BFLOAT16_NP)
    to_bf16_into(nd.array(x), out)
    np.testing.assert_array_equal(out.asnumpy().view(np.uint16), _amp_cast(nd.array(x)))


def test_ordinary_values_are_splittable() -> None:
    rng = np.random.default_rng(0)
    assert splittable([nd.array(rng.normal(size=(1000,)) * 1e6), nd.zeros(3)])
    assert splittable([])


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan, 2.0**64, -3e38])
def test_values_the_splitting_cannot_take_are_not_splittable(bad: float) -> None:
    x = np.ones(100, np.float32)
    x[37] = bad
    assert not splittable([nd.ones(5), nd.array(x)])


def test_from_bf16_is_exact() -> None:
    """``Cast`` widens exactly: ``amp_cast``'s bits, but for bfloat16 subnormals (which
    ``amp_cast`` writes as 0 and never makes) and NaN payloads."""
    high = np.arange(1 << 16, dtype=np.uint32)
    low = nd.Cast(nd.array((high << 16).view(np.float32)), dtype=BFLOAT16_NP)  # every pattern
    out = nd.zeros(high.shape)
    from_bf16_into(low, out)
    got = out.asnumpy()
    exact = (high << 16).view(np.float32)
    same = np.isnan(exact) | (got.view(np.uint32) == exact.view(np.uint32))
    assert same.all()
    want = nd.amp_cast(low, dtype="float32").asnumpy()
    normal = ~np.isnan(exact) & ((np.abs(exact) >= 2.0**-126) | (exact == 0))
    np.testing.assert_array_equal(np.abs(got[normal]), np.abs(want[normal]))


@pytest.mark.parametrize("huge", [False, True])
def test_the_steps_copies_of_large_arrays_keep_amp_multicasts_bits(huge: bool) -> None:
    """``cast_pairs`` on large and small arrays, both directions; with a value past the
    splitting's range the group goes to ``amp_multicast`` (same bits, infinities kept)."""
    rng = np.random.default_rng(0)
    values = [_every_interval()[: 1 << 17], rng.normal(size=40000), rng.normal(size=300)]
    values = [np.nan_to_num(np.asarray(v, np.float32), posinf=1.0, neginf=-1.0) for v in values]
    values = [np.where(np.abs(v) < 2.0**64, v, 0.5).astype(np.float32) for v in values]
    if huge:
        values[1][7], values[1][8] = 1e36, np.inf
    sources = [nd.array(v) for v in values]
    low = [nd.zeros(v.shape, dtype=BFLOAT16_NP) for v in values]
    multi_tensor.cast_pairs(list(zip(sources, low, strict=True)))
    for src, got in zip(sources, low, strict=True):
        np.testing.assert_array_equal(got.asnumpy().view(np.uint16), _amp_cast(src))
    back = [nd.zeros(v.shape) for v in values]
    multi_tensor.cast_pairs(list(zip(low, back, strict=True)))
    for src, got in zip(low, back, strict=True):
        want = nd.amp_cast(src, dtype="float32").asnumpy()
        np.testing.assert_array_equal(got.asnumpy(), want)


def _train(monkeypatch: pytest.MonkeyPatch, multi: bool) -> list[np.ndarray]:
    monkeypatch.setenv(multi_tensor.ENV, "1" if multi else "0")
    mx.random.seed(0)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(256, in_units=256, activation="relu"), gluon.nn.Dense(4, in_units=256))
    net.initialize(mx.init.Xavier())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the island warning, on CPUs with islands
        trainer = Trainer(net, "sgd", {"learning_rate": 0.1, "momentum": 0.9}, policy="O2-bf16")
    rng = np.random.default_rng(1)
    loss_fn = gluon.loss.L2Loss()
    for _ in range(4):
        x = nd.array(rng.normal(size=(8, 256)).astype(np.float32))
        y = nd.array(rng.normal(size=(8, 4)).astype(np.float32))
        with autograd.record():
            loss = loss_fn(net(x), y)
        with trainer.scale_loss(loss) as scaled:
            scaled.backward()
        trainer.step(8)
    return [p.data().asnumpy().view(np.uint16) for p in net.collect_params().values()]


def test_o2_bf16_trains_bit_for_bit_as_with_amp_cast(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 65,536-weight layer (cast by float32 ops in the multi-tensor step) and small ones:
    the weights after four steps are those of the per-parameter path (``amp_cast``)."""
    per_param = _train(monkeypatch, multi=False)
    multi = _train(monkeypatch, multi=True)
    for a, b in zip(per_param, multi, strict=True):
        np.testing.assert_array_equal(a, b)


def _graph(sym: mx.sym.Symbol, x: np.ndarray, dtype: object, head: np.ndarray) -> list[np.ndarray]:
    """Forward ``sym`` on ``x`` (given in ``dtype``), backward ``head``: [output, gradient],
    both as float32."""
    data = nd.amp_cast(nd.array(x), dtype=dtype)
    grad = nd.zeros(x.shape, dtype=dtype)
    ex = sym.bind(mx.cpu(), {"x": data}, args_grad={"x": grad})
    ex.forward(is_train=True)
    ex.backward(nd.amp_cast(nd.array(head), dtype=ex.outputs[0].dtype))
    return [nd.amp_cast(a, dtype="float32").asnumpy() for a in (ex.outputs[0], grad)]


def _ordinary(rng: np.random.Generator, n: int) -> np.ndarray:
    """float32 values over 80 binades, both signs, with every tie pattern of LOWS."""
    x = (rng.normal(size=n) * np.exp2(rng.integers(-40, 40, size=n))).astype(np.float32)
    bits = x.view(np.uint32)
    bits[:] = (bits & np.uint32(0xFFFF0000)) | LOWS[np.arange(n) % len(LOWS)]
    return x


@pytest.mark.parametrize("direction", ["to", "from"])
def test_the_graph_casts_have_amp_casts_bits_forward_and_backward(direction: str) -> None:
    """``symbol_to_bf16`` / ``symbol_from_bf16`` (the islands' casts of outputs and bfloat16
    weights) against ``amp_cast``: outputs and gradients bit for bit, but a zero's sign."""
    from mixprec_mxnet.bf16_rounding import symbol_from_bf16, symbol_to_bf16

    rng = np.random.default_rng(3)
    x, head = _ordinary(rng, 1 << 16), _ordinary(rng, 1 << 16)
    var = mx.sym.var("x")
    if direction == "to":
        got = _graph(symbol_to_bf16(var), x, np.float32, head)
        want = _graph(mx.sym.amp_cast(var, dtype=BFLOAT16_NP), x, np.float32, head)
    else:
        got = _graph(symbol_from_bf16(var), x, BFLOAT16_NP, head)
        want = _graph(mx.sym.amp_cast(var, dtype="float32"), x, BFLOAT16_NP, head)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)  # -0 == +0
        nonzero = w != 0
        np.testing.assert_array_equal(g.view(np.uint32)[nonzero], w.view(np.uint32)[nonzero])


def test_o2_bf16_islands_train_as_with_amp_cast(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hybridized O2-bf16 CNN for three steps, with the islands' graph casts as they are and
    with ``amp_cast`` in their place: the same weights, bit for bit (on a CPU with bfloat16
    kernels there are fewer islands, and the comparison holds all the same)."""
    from mixprec_mxnet.wrapping import islands

    def run() -> list[np.ndarray]:
        mx.random.seed(0)
        net = gluon.nn.HybridSequential()
        net.add(
            gluon.nn.Conv2D(8, 3, in_channels=3, activation="relu"),
            gluon.nn.BatchNorm(in_channels=8),
            gluon.nn.MaxPool2D(),
            gluon.nn.Dense(10, in_units=8 * 7 * 7),
        )
        net.initialize(mx.init.Xavier())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = Trainer(net, "sgd", {"learning_rate": 0.1, "momentum": 0.9}, policy="O2-bf16")
        net.hybridize()
        rng = np.random.default_rng(2)
        loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
        for _ in range(3):
            x = nd.array(rng.normal(size=(4, 3, 16, 16)).astype(np.float32))
            y = nd.array(rng.integers(0, 10, size=4))
            with autograd.record():
                loss = loss_fn(net(x), y)
            with trainer.scale_loss(loss) as scaled:
                scaled.backward()
            trainer.step(4)
        return [p.data().asnumpy().view(np.uint16) for p in net.collect_params().values()]

    fast = run()
    monkeypatch.setattr(islands, "symbol_to_bf16", lambda v: mx.sym.amp_cast(v, dtype=BFLOAT16_NP))
    monkeypatch.setattr(islands, "symbol_from_bf16", lambda v: mx.sym.amp_cast(v, dtype="float32"))
    slow = run()
    for a, b in zip(fast, slow, strict=True):
        np.testing.assert_array_equal(a, b)
