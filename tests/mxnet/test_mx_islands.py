"""float32 islands in bfloat16 nets: BatchNorm islands (where oneDNN can fuse the casts), and
single ops without a bfloat16 kernel on this CPU (the probe in
:mod:`mixprec_mxnet.bf16_kernels`)."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

from _mx_nets import batch, bf16_computes, cnn, mlp, train_step  # noqa: E402
from mxnet import autograd, gluon, nd  # noqa: E402

import mixprec.mxnet as mpx  # noqa: E402
from mixprec_mxnet.bf16_kernels import missing_bf16_cpu_ops  # noqa: E402
from mixprec_mxnet.bf16_rounding import OUT_SUFFIX  # noqa: E402
from mixprec_mxnet.dtypes import dtype_of  # noqa: E402
from mixprec_mxnet.o1.graph import node_dtypes  # noqa: E402
from mixprec_mxnet.wrapping import casting  # noqa: E402

pytestmark = pytest.mark.mxnet

L2 = gluon.loss.L2Loss()


def _source(node: dict) -> str:
    """A node's op, or ``mixprec_cast`` for the last node of one of mixprec's casts."""
    return "mixprec_cast" if node["name"].endswith(OUT_SUFFIX) else node["op"]


def _batchnorm_inputs(net: object) -> list[str]:
    """The op feeding each BatchNorm in the hybridized graph, in order."""
    graph = json.loads(net._cached_graph[1].tojson(remove_amp_cast=False))  # type: ignore[attr-defined]
    nodes = graph["nodes"]
    return [_source(nodes[n["inputs"][0][0]]) for n in nodes if n["op"] == "BatchNorm"]


@pytest.mark.cpu_isa
def test_batchnorm_after_a_blocked_conv_reads_bf16_and_keeps_fp32_statistics() -> None:
    net = cnn()
    mpx.Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
    net.hybridize()
    x, _ = batch(image=True)
    net(x)
    # the first conv reads 1 channel (plain NCHW output): the island keeps its casts; the
    # second reads 16 (oneDNN's blocked layout): BatchNorm takes bf16 data directly.
    # Where the CPU has no bfloat16 Convolution kernel, the conv is a float32 island itself
    # and BatchNorm's island reads its output rounded to bfloat16, widened by mixprec's fast
    # cast (chained islands: no amp_cast)
    if bf16_computes("Convolution") == "float32":
        assert _batchnorm_inputs(net) == ["mixprec_cast", "mixprec_cast"]
    else:
        fused = bf16_computes("BatchNorm") == "bfloat16"
        assert _batchnorm_inputs(net) == ["amp_cast", "Convolution" if fused else "amp_cast"]
    bn = net[4]
    assert {p.dtype for p in bn.collect_params().values()} == {np.float32}


def test_fused_island_matches_the_cast_island() -> None:
    x, _ = batch(image=True)
    outputs = []
    for hybrid in (False, True):  # imperative nets always cast around the island
        net = cnn(seed=3)
        mpx.Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
        if hybrid:
            net.hybridize()
        with mx.autograd.record():
            outputs.append(net(x).asnumpy())
    imperative, hybridized = outputs
    assert hybridized.dtype == np.float32
    np.testing.assert_allclose(hybridized, imperative, rtol=0.05, atol=0.05)


# ---------------------------------------------------------------- ops without a bf16 kernel


@pytest.mark.cpu_isa
def test_dense_computes_in_bf16_or_as_an_island_with_bf16_weights() -> None:
    net = mlp()
    trainer = mpx.Trainer(net, "sgd", {"learning_rate": 0.1, "momentum": 0.9}, policy="O2-bf16")
    net.hybridize()
    x, y = batch()
    before = net[1].weight.data().astype("float32").asnumpy()
    train_step(net, trainer, x, y, L2)
    assert not trainer.last_step_skipped
    dtypes = node_dtypes(net._cached_graph[1], data="bfloat16")
    fc = [name for name in dtypes if name.endswith("_fwd") and name.startswith(net[1].name)]
    assert dtypes[fc[0]] == bf16_computes("FullyConnected")  # float32 inside the island
    # the island is cast back: weights, their gradients and the net's activations stay bf16
    assert dtype_of(net[1].weight.data()) == dtype_of(net[1].weight.grad()) == "bfloat16"
    assert dtype_of(net[0](mpx.cast(x, "bfloat16"))) == "bfloat16"
    assert {dtype_of(m.data()) for m in trainer.master_params()} == {"float32"}
    assert not np.array_equal(before, net[1].weight.data().astype("float32").asnumpy())


def test_o3_batchnorm_island_still_updates_its_running_statistics() -> None:
    net = cnn()
    mpx.Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O3-bf16")
    net.hybridize()
    x, _ = batch(image=True)
    mean = net[1].running_mean
    before = mean.data().asnumpy().copy()
    with autograd.record():
        out = net(x)
    out.backward()  # MXNet writes the running statistics in the backward pass
    assert dtype_of(mean.data()) == "float32"
    assert not np.array_equal(before, mean.data().asnumpy())


def test_o2_custom_block_dot_runs_as_an_island() -> None:
    """O2 casts around ops with no bfloat16 kernel inside user blocks too (``F.dot``)."""

    class Gram(gluon.HybridBlock):
        def __init__(self) -> None:
            super().__init__()
            self.dense = gluon.nn.Dense(4, in_units=8)

        def hybrid_forward(self, F, x):  # type: ignore[no-untyped-def]
            h = self.dense(x)
            return F.dot(h, h, transpose_b=True)

    for hybrid in (False, True):
        net = Gram()
        net.initialize()
        mpx.Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O3-bf16")
        if hybrid:
            net.hybridize()
        out = net(nd.ones((2, 8)))
        assert dtype_of(out) == "bfloat16"


# ---------------------------------------------------------------- chained islands

CNN_ISLANDS = {"Convolution", "BatchNorm", "Activation", "Pooling", "FullyConnected"}


@pytest.mark.cpu_isa
@pytest.mark.skipif(
    not CNN_ISLANDS <= missing_bf16_cpu_ops(),
    reason="this CPU has bfloat16 kernels for the CNN's ops: they are not islands here",
)
@pytest.mark.parametrize("hybrid", [False, True])
def test_a_run_of_islands_rounds_every_activation_as_amp_cast_would(
    hybrid: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where every op of the CNN is a float32 island, each island's output is rounded to
    bfloat16 before the next island reads it, as O2-bf16 says (issue 37: the chain used to
    pass the unrounded float32 value on). The chain widens the rounded value by fast casts;
    outputs and gradients are those of the same net with ``amp_cast`` between the islands
    (the chain turned off), bit for bit, and not those of float32 activations."""
    x, _ = batch(image=True)

    def run(chained: bool) -> tuple[np.ndarray, np.ndarray]:
        net = cnn(seed=5)
        mpx.Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
        if not chained:
            monkeypatch.setattr(casting, "chained_islands", contextlib.nullcontext)
        if hybrid:
            net.hybridize()
        with autograd.record():
            out = net(x)
        out.backward()
        monkeypatch.undo()
        grad = mpx.cast(net[0].weight.grad(), "float32").asnumpy()
        return mpx.cast(out, "float32").asnumpy(), grad

    (out, grad), (out_amp, grad_amp) = run(True), run(False)
    np.testing.assert_array_equal(out, out_amp)
    np.testing.assert_array_equal(grad, grad_amp)

    # the float32 net on the same bfloat16 weights and input: other values
    net, reference = cnn(seed=5), cnn(seed=5)
    mpx.Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
    for mine, theirs in zip(
        reference.collect_params().values(), net.collect_params().values(), strict=True
    ):
        mine.set_data(mpx.cast(theirs.data(), "float32"))  # the bf16-rounded weights
    with autograd.record():
        float32_out = reference(mpx.cast(mpx.cast(x, "bfloat16"), "float32"))
    assert not np.array_equal(out, mpx.cast(mpx.cast(float32_out, "bfloat16"), "float32").asnumpy())


@pytest.mark.cpu_isa
def test_an_activation_read_outside_the_islands_stays_bfloat16() -> None:
    """A bfloat16-capable op reading an island's output (here the user's own ``+``) gets the
    bfloat16 value; the next island the same value, widened by mixprec's fast cast."""

    class Residual(gluon.HybridBlock):
        def __init__(self) -> None:
            super().__init__()
            self.inner = gluon.nn.Dense(8, in_units=8)
            self.outer = gluon.nn.Dense(8, in_units=8)

        def hybrid_forward(self, F, x):  # type: ignore[no-untyped-def]
            h = self.inner(x)
            return self.outer(h) + h

    net = Residual()
    net.initialize(mx.init.Xavier())
    mpx.Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O3-bf16")
    net.hybridize()
    assert dtype_of(net(nd.ones((2, 8)))) == "bfloat16"
    graph = json.loads(net._cached_graph[1].tojson(remove_amp_cast=False))  # type: ignore[attr-defined]
    nodes = graph["nodes"]
    dtypes = node_dtypes(net._cached_graph[1], data="bfloat16")  # type: ignore[attr-defined]
    # the user's + is the graph's last add (the islands' casts to bfloat16 add before it)
    add = [n for n in nodes if n["op"] in ("elemwise_add", "_plus", "_Plus")][-1]
    assert dtypes[add["name"]] == "bfloat16"
    assert {dtypes[nodes[i]["name"]] for i, *_ in add["inputs"]} == {"bfloat16"}
    fc = [n for n in nodes if n["op"] == "FullyConnected"]
    if bf16_computes("FullyConnected") == "float32":  # two islands in a row
        assert _source(nodes[fc[1]["inputs"][0][0]]) == "mixprec_cast"  # no amp_cast


def test_the_island_warning_points_at_the_users_trainer_line() -> None:
    """Where this CPU runs a bfloat16 policy slowly (ops without a bfloat16 kernel, or
    emulated ones: the backend's own probes say which), the warning names the line that
    built the Trainer, not mixprec's code."""
    import warnings

    from mixprec_mxnet.bf16_kernels import Bf16IslandWarning, bf16_cpu_is_fast

    if not missing_bf16_cpu_ops() and bf16_cpu_is_fast():
        pytest.skip("this CPU runs every bfloat16 op fast: no island warning to point anywhere")
    net = mlp()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        mpx.Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
    (warning,) = [w for w in seen if issubclass(w.category, Bf16IslandWarning)]
    assert warning.filename == __file__, (warning.filename, warning.lineno)
