"""Nets and habits as Gluon users have them: one Trainer per net, failed constructions,
plain Sequentials, nets without parameters, export for deployment, "adamw"."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

from _mx_nets import batch, bf16_computes, cnn, mlp  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

import mixprec.mxnet  # noqa: E402
from mixprec.errors import MixprecWarning, WrapError  # noqa: E402
from mixprec_mxnet import Trainer  # noqa: E402
from mixprec_mxnet.diagnostics import module_dtypes  # noqa: E402
from mixprec_mxnet.dtypes import cast, dtype_name  # noqa: E402

pytestmark = pytest.mark.mxnet

L2 = gluon.loss.L2Loss()
CE = gluon.loss.SoftmaxCrossEntropyLoss()


def _state(net: Any) -> dict[str, tuple[str, np.ndarray]]:
    return {
        n: (str(np.dtype(p.dtype)), cast(p.data(), "float32").asnumpy())
        for n, p in net.collect_params().items()
    }


def _train(net: Any, trainer: Any, x: Any, y: Any, loss_fn: Any = L2, steps: int = 2) -> None:
    for _ in range(steps):
        with autograd.record():
            loss = loss_fn(cast(net(x), "float32"), y)
        loss.backward()
        trainer.step(x.shape[0])


def test_a_second_trainer_on_the_same_net_is_refused() -> None:
    net = mlp()
    Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
    before = _state(net)
    with pytest.raises(WrapError, match="one Trainer per net"):
        Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
    with pytest.raises(WrapError, match="already belongs"):
        Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
    for name, (dtype, value) in _state(net).items():
        assert dtype == before[name][0]
        np.testing.assert_array_equal(value, before[name][1])


def test_a_failed_construction_leaves_the_net_as_it_was() -> None:
    """kvstore='dist_sync' without a launcher fails after the parameters were cast."""
    net = mlp()
    net.hybridize()
    x, y = batch()
    reference = net(x).asnumpy()
    before = _state(net)
    with pytest.raises(mx.base.MXNetError):
        Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16", kvstore="dist_sync")
    assert _state(net).keys() == before.keys()
    for name, (dtype, value) in _state(net).items():
        assert dtype == "float32", name
        np.testing.assert_array_equal(value, before[name][1])
    out = net(x)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out.asnumpy(), reference)
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")  # not claimed
    _train(net, trainer, x, y)


def test_a_net_without_parameters_is_refused() -> None:
    with pytest.raises(WrapError, match="no parameters"):
        Trainer(gluon.nn.HybridSequential(), "sgd", {"learning_rate": 0.1}, policy="O2-bf16")


BF16_PRESETS = ["O1-bf16", "O2-bf16", "O3-bf16", "O3-bf16-kahan", "O3-bf16-sr"]


@pytest.mark.parametrize("policy", BF16_PRESETS)
def test_deferred_plain_sequential_trains_under_every_bf16_preset(policy: str) -> None:
    """A plain gluon.nn.Sequential (not hybridizable) holding a model_zoo net and Dense
    layers without in_units: O2/O3 used to refuse it at Trainer construction."""
    from mxnet.gluon.model_zoo import vision

    mx.random.seed(0)
    net = gluon.nn.Sequential()
    net.add(vision.mobilenet0_25(pretrained=False, classes=16),
            gluon.nn.Dense(32, activation="relu"), gluon.nn.Dense(4))  # fmt: skip
    net.initialize(mx.init.Xavier())
    trainer = Trainer(net, "sgd", {"learning_rate": 0.05}, policy=policy)
    assert trainer.masters is None  # nothing to cast before the first forward
    rng = np.random.RandomState(0)
    x, y = mx.nd.array(rng.rand(2, 3, 32, 32)), mx.nd.array([1, 2])
    _train(net, trainer, x, y, CE)
    assert not trainer.last_step_skipped
    assert net[1].weight.shape == (32, 16)
    lowp = policy != "O1-bf16"
    assert dtype_name(net[1].weight.dtype) == ("bfloat16" if lowp else "float32")
    assert dtype_name(trainer.masters.master_for(net[1].weight).dtype) == "float32"


class _Residual(gluon.Block):
    """Any Block: a forward in Python around deferred layers."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = gluon.nn.Dense(8)
        self.outer = gluon.nn.Dense(4)

    def forward(self, x: Any) -> Any:
        h = self.inner(x)
        return self.outer(h + mx.nd.relu(h))


def test_any_block_with_deferred_shapes_is_cast_on_its_first_forward() -> None:
    mx.random.seed(0)
    net = _Residual()
    net.initialize(mx.init.Xavier())
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
    x, y = batch()
    _train(net, trainer, x, y, L2)
    assert net.inner.weight.shape == (8, 8)
    assert dtype_name(net.inner.weight.dtype) == "bfloat16"
    assert not trainer.last_step_skipped


@pytest.mark.parametrize("hybrid", [False, True], ids=["Sequential", "HybridSequential"])
def test_a_first_input_that_does_not_fit_is_refused_and_changes_nothing(hybrid: bool) -> None:
    """A deferred net's first forward with an input the net cannot take (2-D data into a
    Conv2D) was a deep MXNet traceback, and it left some layers initialised with wrong shapes."""
    net = gluon.nn.HybridSequential() if hybrid else gluon.nn.Sequential()
    net.add(gluon.nn.Dense(8, flatten=False), gluon.nn.Conv2D(4, 3), gluon.nn.Dense(2))
    net.initialize()
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
    with pytest.raises(WrapError, match=r"shape \(2, 5\).*do not fit the net"):
        net(mx.nd.ones((2, 5)))
    assert all(p._deferred_init for p in net.collect_params().values() if p.shape[-1] == 0)
    assert trainer.masters is None
    out = net(mx.nd.ones((2, 1, 6, 5)))  # the input it is built for: trains as usual
    assert dtype_name(net[1].weight.dtype) == "bfloat16" and out.shape == (2, 2)


def test_the_documented_idiom_reads_an_o3_bf16_loss_as_a_float() -> None:
    """Under O3-bf16 the loss is bfloat16, which MXNet keeps in a structured numpy dtype:
    ``loss.mean().asscalar()`` is a ``numpy.void``. docs/guide.md gives the idiom."""
    net = cnn()
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O3-bf16")
    x, y = batch(image=True)
    with autograd.record():
        loss = CE(net(x), y)
        with trainer.scale_loss(loss) as scaled:
            autograd.backward(scaled)
    trainer.step(x.shape[0])
    assert isinstance(loss.mean().asscalar(), np.void)  # MXNet's bfloat16, as it is
    value = float(mixprec.mxnet.cast(loss, "float32").mean().asscalar())  # the guide's idiom
    bits = np.frombuffer(loss.asnumpy().tobytes(), dtype=np.uint16)  # bfloat16, decoded
    reference = (bits.astype(np.uint32) << 16).view(np.float32).mean()
    assert isinstance(value, float) and value == pytest.approx(reference, rel=1e-6)


def test_plain_sequential_with_deferred_shapes_trains() -> None:
    mx.random.seed(0)
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(16, activation="relu"), gluon.nn.Dense(4))
    net.initialize(mx.init.Xavier())
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O1-bf16")
    x, y = batch()
    first = None
    for _ in range(5):
        with autograd.record():
            loss = L2(net(x), y)
        loss.backward()
        trainer.step(x.shape[0])
        first = first if first is not None else float(loss.mean().asscalar())
    assert float(loss.mean().asscalar()) < first
    assert net[0].weight.shape == (16, 8)


def test_export_gives_a_deployable_float32_model(tmp_path: Path) -> None:
    net = cnn()
    net.hybridize()
    x, y = batch(image=True)
    net(x)  # traced in float32 before the Trainer: the conversion retraces it
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
    _train(net, trainer, x, y, CE)
    trained = cast(net(x), "float32").asnumpy()
    prefix = str(tmp_path / "model")
    for dtype, tolerance in (("float32", 2e-2), ("bfloat16", 0.0)):
        net.export(prefix, dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # MXNet: "Cannot decide type ... data"
            imported = gluon.SymbolBlock.imports(
                f"{prefix}-symbol.json", ["data"], f"{prefix}-0000.params"
            )
        out = imported(x)
        assert out.dtype == np.float32
        scale = np.abs(trained).max()
        np.testing.assert_allclose(out.asnumpy(), trained, atol=tolerance * scale, err_msg=dtype)
    loaded = mx.nd.load(f"{prefix}-0000.params")
    net.export(prefix)
    loaded = mx.nd.load(f"{prefix}-0000.params")
    assert {str(v.dtype) for v in loaded.values()} == {"<class 'numpy.float32'>"}
    master = trainer.masters.master_for(net[0].weight).data().asnumpy()
    np.testing.assert_array_equal(loaded[f"arg:{net[0].weight.name}"].asnumpy(), master)


def _adamw_reference(w: np.ndarray, g: np.ndarray, lr: float, wd: float, t: int) -> np.ndarray:
    m, v = 0.1 * g, 0.001 * g * g
    step = np.sqrt(1 - 0.999**t) / (1 - 0.9**t) * m / (np.sqrt(v) + 1e-8)
    return w - lr * (step + wd * w)


def test_adamw_runs_on_the_float32_masters() -> None:
    net = mlp()
    trainer = Trainer(net, "adamw", {"learning_rate": 1e-2, "wd": 0.1}, policy="O2-bf16")
    x, y = batch()
    with autograd.record():
        loss = L2(net(x), y)
    loss.backward()
    trainer.allreduce_grads()
    weight = net[0].weight
    master = trainer.masters.master_for(weight)
    before = master.data().asnumpy().copy()
    grad = master.grad().asnumpy().copy() / x.shape[0]
    trainer.update(x.shape[0])
    expected = _adamw_reference(before, grad, 1e-2, 0.1, 1)
    np.testing.assert_allclose(master.data().asnumpy(), expected, rtol=1e-5, atol=1e-6)
    assert np.dtype(weight.dtype) != np.float32  # the model keeps bfloat16, the master float32


def test_metrics_with_o3_bf16_and_float32_outputs() -> None:
    """mx.metric reads predictions with asnumpy, which has no bfloat16 arithmetic: O3's
    output role set to float32 gives the metric float32 predictions of the bfloat16 net."""
    net = mlp()
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O3-bf16", output="float32")
    assert trainer.policy.param == "bfloat16"
    x, y = batch()
    _train(net, trainer, x, y)
    out = net(x)
    assert out.dtype == np.float32
    metric = mx.metric.MSE()
    metric.update([y], [out])
    expected = ((out.asnumpy() - y.asnumpy()) ** 2).mean()
    assert metric.get()[1] == pytest.approx(float(expected), rel=1e-5)


def test_sparse_grad_embedding_trains_with_dense_gradients() -> None:
    def make() -> Any:
        mx.random.seed(0)
        net = gluon.nn.HybridSequential()
        net.add(
            gluon.nn.Embedding(10, 8, sparse_grad=True),
            gluon.nn.Dense(4, in_units=8, flatten=False),
        )
        net.initialize(mx.init.Xavier())
        return net

    net = make()
    with pytest.warns(MixprecWarning, match="dense"):
        trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
    tokens = mx.nd.array([[1, 2], [3, 1]])
    target = mx.nd.ones((2, 2, 4))
    before = cast(net[0].weight.data(), "float32").asnumpy()
    _train(net, trainer, tokens, target)
    after = cast(net[0].weight.data(), "float32").asnumpy()
    changed = np.abs(after - before).sum(axis=1) > 0
    assert changed.tolist() == [i in (1, 2, 3) for i in range(10)]  # rows looked up only


def _exported_cnn(tmp_path: Path) -> tuple[Any, Any]:
    """A Conv-BatchNorm net exported and imported back as a SymbolBlock, and its input."""
    net = cnn()
    net.hybridize()
    x, _ = batch(image=True)
    net(x)
    net.export(str(tmp_path / "plain"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MXNet: "Cannot decide type ... data"
        block = gluon.SymbolBlock.imports(
            str(tmp_path / "plain-symbol.json"), ["data"], str(tmp_path / "plain-0000.params")
        )
    return block, net(x).asnumpy()


def test_imported_symbolblock_with_batchnorm_trains_under_o2_bf16(tmp_path: Path) -> None:
    block, reference = _exported_cnn(tmp_path)
    trainer = Trainer(block, "sgd", {"learning_rate": 0.01}, policy="O2-bf16")
    dtypes = {n: str(np.dtype(p.dtype)) for n, p in block.collect_params().items()}
    assert all(dtypes[n] == "float32" for n in dtypes if "batchnorm" in n)
    conv_weight = next(n for n in dtypes if "conv" in n and n.endswith("_weight"))
    assert dtypes[conv_weight] != "float32"
    x, y = batch(image=True)
    out = cast(block(x), "float32").asnumpy()
    np.testing.assert_allclose(out, reference, atol=0.05 * np.abs(reference).max())
    _train(block, trainer, x, y, CE)


@pytest.mark.cpu_isa
@pytest.mark.parametrize("imported", [True, False], ids=["SymbolBlock", "Gluon block"])
def test_batchnorm_relu_keeps_float32_parameters_under_o2_bf16(
    tmp_path: Path, imported: bool
) -> None:
    """``BatchNormReLU``'s op (``_contrib_BatchNormWithReLU``) needs float32 gamma/beta like
    BatchNorm's; in an imported graph they became bfloat16 and MXNet refused the graph
    ("Expected 'float32' v.s. given 'bfloat16' at 'gamma'")."""
    mx.random.seed(0)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(16, 3, padding=1, in_channels=1), gluon.nn.BatchNormReLU(),
            gluon.nn.Flatten(), gluon.nn.Dense(10))  # fmt: skip
    net.initialize(mx.init.Xavier())
    net.hybridize()
    x, y = batch(image=True)
    reference = net(x).asnumpy()
    block = net
    if imported:
        net.export(str(tmp_path / "bnrelu"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # MXNet: "Cannot decide type ... data"
            block = gluon.SymbolBlock.imports(
                str(tmp_path / "bnrelu-symbol.json"), ["data"], str(tmp_path / "bnrelu-0000.params")
            )
    trainer = Trainer(block, "sgd", {"learning_rate": 0.01}, policy="O2-bf16")
    dtypes = {n: dtype_name(p.dtype) for n, p in block.collect_params().items()}
    assert {dtypes[n] for n in dtypes if "batchnormrelu" in n} == {"float32"}
    assert {dtypes[n] for n in dtypes if "conv" in n} == {"bfloat16"}
    out = cast(block(x), "float32").asnumpy()
    np.testing.assert_allclose(out, reference, atol=0.05 * np.abs(reference).max())
    _train(block, trainer, x, y, CE)
    assert not trainer.last_step_skipped


@pytest.mark.cpu_isa
def test_consecutive_islands_of_an_imported_graph_pass_float32(tmp_path: Path) -> None:
    """Where Convolution and BatchNorm are both islands, the imported graph's BatchNorm reads
    the convolution's float32 output: no cast to bfloat16 and back between them."""
    if bf16_computes("Convolution") != "float32" or bf16_computes("BatchNorm") != "float32":
        pytest.skip("this CPU has bfloat16 Convolution/BatchNorm kernels: no islands")
    block, reference = _exported_cnn(tmp_path)
    Trainer(block, "sgd", {"learning_rate": 0.01}, policy="O2-bf16")
    x, _ = batch(image=True)
    out = cast(block(x), "float32").asnumpy()
    np.testing.assert_allclose(out, reference, atol=0.05 * np.abs(reference).max())
    graph = json.loads(block._cached_graph[1].tojson(remove_amp_cast=False))
    nodes = graph["nodes"]
    feeding = [nodes[n["inputs"][0][0]]["op"] for n in nodes if n["op"] == "BatchNorm"]
    assert feeding == ["Convolution", "Convolution"]


@pytest.mark.cpu_isa
def test_dtype_report_names_the_islands_and_float32_params_of_an_imported_graph(
    tmp_path: Path,
) -> None:
    """The imported graph has no child blocks: its ops get the report's rows instead, one for
    each op that runs as a float32 island on this CPU (the probe's verdict) and one for each
    BatchNorm (float32 parameters on every CPU)."""
    block, _ = _exported_cnn(tmp_path)
    trainer = Trainer(block, "sgd", {"learning_rate": 0.01}, policy="O2-bf16")
    x, y = batch(image=True)
    _train(block, trainer, x, y, CE)
    rows = {r.path: r for r in module_dtypes(block)}
    ops = [name for name in rows if name]
    graph_ops = ["Convolution", "BatchNorm", "Activation"] * 2 + ["Pooling"]
    graph_ops += ["FullyConnected", "Activation", "FullyConnected"]
    expected = [op for op in graph_ops if bf16_computes(op) == "float32" or op == "BatchNorm"]
    assert [rows[n].class_name for n in ops] == expected
    for name in ops:
        row = rows[name]
        if row.class_name == "BatchNorm":  # gamma, beta and statistics stay float32
            assert row.param_dtype == "float32"
        computes = bf16_computes(row.class_name)
        assert row.compute == computes
        if computes == "float32":
            assert row.rule == f"float32 island: no bfloat16 {row.class_name} kernel here"
        else:
            assert row.class_name == "BatchNorm"
            assert row.rule == "float32 params: MXNet's BatchNorm kernel needs them"
    convs = [n for n in ops if rows[n].class_name == "Convolution"]
    assert all(rows[conv].param_dtype == "bfloat16" for conv in convs)
    assert all(conv in mixprec.mxnet.dtype_report(block) for conv in convs)


def test_a_net_converted_by_mxnet_amp_is_refused(tmp_path: Path) -> None:
    from mxnet.contrib import amp

    net = cnn()
    net.hybridize()
    x, _ = batch(image=True)
    net(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MXNet: "Cannot decide type ... data"
        converted = amp.convert_hybrid_block(net, target_dtype="bfloat16", ctx=mx.cpu())
    with pytest.raises(WrapError, match="convert_hybrid_block"):
        Trainer(converted, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")


def test_a_converted_net_whose_output_is_not_a_cast_is_refused() -> None:
    """MXNet AMP leaves softmax in float32, so this graph's output is no cast, and
    ``Symbol.tojson()`` (which drops the inner casts) shows none: still refused."""

    class Classifier(gluon.HybridBlock):
        def __init__(self) -> None:
            super().__init__()
            self.dense = gluon.nn.Dense(4, in_units=8)

        def hybrid_forward(self, F, x):  # type: ignore[no-untyped-def]
            return F.softmax(self.dense(x))

    from mxnet.contrib import amp

    net = Classifier()
    net.initialize()
    net.hybridize()
    net(mx.nd.ones((2, 8)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MXNet: "Cannot decide type ... data"
        converted = amp.convert_hybrid_block(net, target_dtype="bfloat16", ctx=mx.cpu())
    before = _state(converted)
    with pytest.raises(WrapError, match="convert_hybrid_block"):
        Trainer(converted, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
    after = _state(converted)
    assert before.keys() == after.keys()
    assert all(before[n][0] == after[n][0] for n in before)


def _import(prefix: str) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MXNet: "Cannot decide type ... data"
        return gluon.SymbolBlock.imports(f"{prefix}-symbol.json", ["data"], f"{prefix}-0000.params")


def test_the_float32_export_trains_again_and_the_bfloat16_one_is_refused(tmp_path: Path) -> None:
    """Fine-tuning a deployed model: the default export holds no cast, so a new Trainer takes
    it; the bfloat16 export has the trained net's casts in its graph and is refused."""
    net = cnn()
    net.hybridize()
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
    x, y = batch(image=True)
    _train(net, trainer, x, y, CE)
    for dtype in ("float32", "bfloat16"):
        net.export(str(tmp_path / dtype), dtype=dtype)
    symbol = (tmp_path / "float32-symbol.json").read_text()
    assert '"amp_cast"' not in symbol and '"amp_multicast"' not in symbol
    deployed = _import(str(tmp_path / "float32"))
    again = Trainer(deployed, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
    _train(deployed, again, x, y, CE)
    assert not again.last_step_skipped
    with pytest.raises(WrapError, match="dtype='bfloat16'"):
        Trainer(_import(str(tmp_path / "bfloat16")), "sgd", policy="O2-bf16")


def test_o1_warns_when_the_graph_is_switched_off() -> None:
    net = mlp()
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O1-bf16")
    net.hybridize(active=False)
    x, y = batch()
    with pytest.warns(MixprecWarning, match="hybridize"):
        _train(net, trainer, x, y, steps=1)
