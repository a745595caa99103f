"""``mixprec.compat.mxnet_amp``: MXNet's contrib.amp code with one import changed.

MXNet's documented AMP loop (``amp.init``, a plain ``gluon.Trainer``, ``amp.init_trainer``,
``amp.scale_loss``) trains through the drop-in as well as float32 does; the trainer becomes
mixprec's in place (exact scaling, float32 checkpoints); refusals change nothing; and the seed
article's Gluon loop runs with only its Trainer line changed.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")
datasets = pytest.importorskip("sklearn.datasets")

from _mx_nets import array, batch, mlp, values  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

import mixprec.mxnet as mpx  # noqa: E402
from mixprec import get_policy  # noqa: E402
from mixprec.compat import mxnet_amp as amp  # noqa: E402
from mixprec.errors import (  # noqa: E402
    PolicyError,
    StepOrderError,
    UnsupportedDtypeError,
    WrapError,
)
from mixprec_mxnet.bf16_rounding import OUT_SUFFIX  # noqa: E402
from mixprec_mxnet.dtypes import dtype_name  # noqa: E402
from mixprec_mxnet.integrations import contrib_amp_lists  # noqa: E402
from mixprec_mxnet.o1.graph import node_dtypes  # noqa: E402

pytestmark = pytest.mark.mxnet

ROOT = Path(__file__).resolve().parents[2]
ARTICLE = ROOT / "examples" / "gluon_article.py"
MIXPREC_LINE = 'trainer = mixprec.mxnet.Trainer(model, optimizer, policy="O2-bf16")'
ARTICLE_LINE = "trainer = gluon.Trainer(model.collect_params(), optimizer)"


@pytest.fixture(autouse=True)
def _fresh_init() -> Iterator[None]:
    """Each test starts before ``amp.init()`` (the drop-in keeps one module-level policy)."""
    before = contrib_amp_lists._State.policy
    contrib_amp_lists._State.policy = None
    yield
    contrib_amp_lists._State.policy = before


def _sgd_trainer(net: Any, **kwargs: Any) -> gluon.Trainer:
    return gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, **kwargs)


def _step(net: Any, trainer: Any, x: Any, y: Any) -> None:
    with autograd.record():
        loss = gluon.loss.L2Loss()(net(x), y)
        with amp.scale_loss(loss, trainer) as scaled:
            autograd.backward(scaled)
    trainer.step(x.shape[0])


# ---------------------------------------------------------------------- the documented loop


@functools.cache
def _contrib_loop_accuracy(use_amp: bool) -> float:
    """MXNet's documented contrib.amp training loop on the digits; without the amp lines
    it is the float32 loop."""
    digits = datasets.load_digits()
    images = digits.images.astype("float32")[:, None] / 16.0
    order = np.random.RandomState(0).permutation(len(images))
    images, labels = images[order], digits.target[order].astype("float32")
    mx.random.seed(0)
    if use_amp:
        amp.init(target_dtype="bfloat16")
    net = gluon.nn.HybridSequential()
    net.add(
        gluon.nn.Conv2D(16, 3, padding=1, activation="relu"),
        gluon.nn.MaxPool2D(),
        gluon.nn.Flatten(),
        gluon.nn.Dense(64, activation="relu"),
        gluon.nn.Dense(10),
    )
    net.initialize(mx.init.Xavier(), ctx=mx.cpu())
    net.hybridize()
    trainer = gluon.Trainer(
        net.collect_params(),
        "sgd",
        {"learning_rate": 0.1, "momentum": 0.9},
        update_on_kvstore=False,
    )
    if use_amp:
        amp.init_trainer(trainer)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    x, y = array(images[:1400]), array(labels[:1400])
    for _epoch in range(6):
        for start in range(0, 1400, 32):
            with autograd.record():
                loss = loss_fn(net(x[start : start + 32]), y[start : start + 32])
                if use_amp:
                    with amp.scale_loss(loss, trainer) as scaled_loss:
                        autograd.backward(scaled_loss)
                else:
                    autograd.backward(loss)
            trainer.step(32)
    scores = net(array(images[1400:])).argmax(axis=1).asnumpy()
    return float((scores == labels[1400:]).mean())


@pytest.mark.slow
def test_contrib_amp_loop_reaches_float32_accuracy_on_digits() -> None:
    fp32 = _contrib_loop_accuracy(False)
    mixed = _contrib_loop_accuracy(True)
    assert fp32 > 0.95
    assert mixed >= fp32 - 0.01


def test_init_trainer_makes_the_gluon_trainer_a_mixprec_trainer_in_place(tmp_path: Path) -> None:
    amp.init(target_dtype="bfloat16")
    net = mlp()
    trainer = _sgd_trainer(net)
    optimizer = trainer.optimizer
    assert amp.init_trainer(trainer) is trainer
    assert isinstance(trainer, mpx.Trainer)
    assert trainer.optimizer is optimizer  # the user's optimizer instance and settings
    assert trainer.policy == get_policy("O1-bf16")
    assert amp.init_trainer(trainer) is trainer  # a second call changes nothing
    x, y = batch()
    before = values(net)
    _step(net, trainer, x, y)
    after = values(net)
    assert all(not np.array_equal(before[k], after[k]) for k in before)
    net.save_parameters(str(tmp_path / "net.params"))
    assert {v.dtype for v in mx.nd.load(str(tmp_path / "net.params")).values()} == {np.float32}
    trainer.save_states(str(tmp_path / "trainer.states"))  # scaler and policy saved with it
    assert mpx.state(trainer).steps == 1


def test_scaling_is_exact_and_unscale_serves_the_clipping_recipe() -> None:
    """With a dynamic scale, ``amp.unscale`` leaves the true gradients in ``p.grad()``
    (clip them as MXNet's docs do); an overflow halves the scale for the very next step."""
    amp.init(target_dtype="bfloat16", loss_scale="dynamic(init=1024)")
    x, y = batch()
    reference = mlp()
    with autograd.record():
        loss = gluon.loss.L2Loss()(reference(x), y)
    loss.backward()
    expected = [p.grad().asnumpy() for p in reference.collect_params().values()]

    net = mlp()
    trainer = amp.init_trainer(_sgd_trainer(net, update_on_kvstore=False))
    with autograd.record():
        loss = gluon.loss.L2Loss()(net(x), y)
        with amp.scale_loss(loss, trainer) as scaled:
            autograd.backward(scaled)
    amp.unscale(trainer)
    grads = [p.grad() for p in net.collect_params().values()]
    for got, want in zip(grads, expected, strict=True):
        # bfloat16 rounding where the CPU computes Dense in bfloat16 (a scale left in would
        # be 1024x): within 2% of the gradient's norm
        error = np.linalg.norm(got.asnumpy() - want)
        assert error <= 0.02 * np.linalg.norm(want), (error, np.linalg.norm(want))
    gluon.utils.clip_global_norm(grads, max_norm=0.5)
    trainer.step(x.shape[0])
    assert mpx.state(trainer).loss_scale == 1024

    with autograd.record():
        loss = gluon.loss.L2Loss()(net(x), y)
        with amp.scale_loss(loss, trainer) as scaled:
            autograd.backward(scaled)
    net[0].weight.grad()[0, 0] = float("inf")
    kept = values(net)
    trainer.step(x.shape[0])
    state = mpx.state(trainer)
    assert state.last_step_skipped and state.loss_scale == 512  # no one-step lag
    assert all(np.array_equal(kept[k], v) for k, v in values(net).items())


def test_init_with_a_mixprec_policy_gives_float32_masters() -> None:
    amp.init(policy="O2-bf16")
    net = mlp()
    trainer = amp.init_trainer(_sgd_trainer(net))
    assert {dtype_name(p.dtype) for p in net.collect_params().values()} == {"bfloat16"}
    assert all(m.dtype == np.float32 for m in trainer.master_params())
    _step(net, trainer, *batch())


# ---------------------------------------------------------------------- refusals


def test_calls_out_of_order_name_the_missing_call() -> None:
    net = mlp()
    trainer = _sgd_trainer(net)
    with pytest.raises(StepOrderError, match=r"amp\.init\("):
        amp.init_trainer(trainer)
    amp.init(target_dtype="bfloat16")
    with pytest.raises(StepOrderError, match=r"amp\.init_trainer\(trainer\)"):
        with amp.scale_loss(mx.nd.ones((1,)), trainer):
            pass
    with pytest.raises(StepOrderError, match="init_trainer"):
        amp.unscale(trainer)
    with pytest.raises(WrapError, match=r"gluon\.Trainer"):
        amp.init_trainer(mx.optimizer.SGD())


def _unchanged(trainer: gluon.Trainer, keys: set[str]) -> bool:
    return type(trainer) is gluon.Trainer and set(vars(trainer)) == keys


@pytest.mark.parametrize("case", ["stepped", "update_on_kvstore", "part of the net", "float16"])
def test_refused_trainers_are_left_as_they_were(case: str) -> None:
    amp.init(target_dtype="float16" if case == "float16" else "bfloat16")
    net = mlp()
    weights = values(net)
    if case == "part of the net":
        weights_only = net.collect_params(".*weight")  # no block owns exactly these
        trainer = gluon.Trainer(weights_only, "sgd", {"learning_rate": 0.1})
    else:
        trainer = _sgd_trainer(net, update_on_kvstore=True if case == "update_on_kvstore" else None)
    if case == "stepped":
        x, y = batch()
        with autograd.record():
            loss = gluon.loss.L2Loss()(net(x), y)
        loss.backward()
        trainer.step(x.shape[0])
        weights = values(net)
    keys = set(vars(trainer))
    expected = {
        "stepped": (StepOrderError, "right after creating"),
        "update_on_kvstore": (WrapError, "update_on_kvstore=False"),
        "part of the net": (WrapError, "grad_req='null'"),
        "float16": (UnsupportedDtypeError, "bfloat16"),
    }[case]
    with pytest.raises(expected[0], match=re.escape(expected[1])):
        amp.init_trainer(trainer)
    assert _unchanged(trainer, keys)
    assert all(np.array_equal(weights[k], v) for k, v in values(net).items())


class _WarnsOnClass:
    """Like torch's deprecated aliases: reading ``__class__`` warns."""

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # type: ignore[override]
        warnings.warn("__class__ read", FutureWarning, stacklevel=2)
        return type(self)


def test_looking_for_the_net_reads_no_other_objects_attributes() -> None:
    amp.init(target_dtype="bfloat16")
    bystander = _WarnsOnClass()  # alive while init_trainer searches  # noqa: F841
    net = mlp()
    trainer = amp.init_trainer(_sgd_trainer(net))  # warnings are errors here
    assert isinstance(trainer, mpx.Trainer)


def test_a_net_that_cannot_be_told_apart_is_passed_by_name() -> None:
    amp.init(target_dtype="bfloat16")
    net = mlp()
    twin = gluon.nn.HybridSequential()  # another net over the very same layers
    twin.add(net[0], net[1])
    trainer = _sgd_trainer(net)
    with pytest.raises(WrapError, match=r"net=net"):
        amp.init_trainer(trainer)
    assert type(trainer) is gluon.Trainer
    amp.init_trainer(trainer, net=net)
    _step(net, trainer, *batch())


# ---------------------------------------------------------------------- conversions and lists


def test_convert_hybrid_block_converts_the_block_in_place() -> None:
    net = mlp()
    x, _ = batch()
    expected = net(x).asnumpy()
    assert amp.convert_hybrid_block(net, target_dtype="bfloat16") is net
    out = net(x)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out.asnumpy(), expected, rtol=5e-2, atol=5e-2)
    with pytest.raises(UnsupportedDtypeError, match="bfloat16"):
        amp.convert_hybrid_block(mlp())  # float16, MXNet's default, has no CPU GEMM
    with pytest.raises(WrapError, match="with_module"):
        amp.convert_hybrid_block(mlp(), "bfloat16", excluded_sym_names=["dense0_fwd"])
    with pytest.raises(WrapError, match="O2-bf16"):
        amp.convert_hybrid_block(mlp(), "bfloat16", cast_optional_params=True)


@pytest.mark.cpu_isa
def test_a_converted_block_exports_before_another_forward_pass(tmp_path: Path) -> None:
    """MXNet's ``convert_hybrid_block`` returns a block ready to export; the in-place
    conversion cleared the traced graph, so ``export`` raised until the next forward. Where
    the CPU has no bfloat16 FullyConnected (AVX2) the MLP's layers are float32 islands whose
    inputs and outputs are rounded to bfloat16 (issue 37, by float32 ops that the float32
    export drops as it drops amp_cast), so the graph has casts either way."""
    net = mlp()
    net.hybridize()
    x, _ = batch()
    expected = net(x).asnumpy()
    amp.convert_hybrid_block(net, target_dtype="bfloat16")
    net.export(str(tmp_path / "fp32"))  # casts removed: the float32 model
    net.export(str(tmp_path / "amp"), remove_amp_cast=False)
    graph = json.loads((tmp_path / "amp-symbol.json").read_text(encoding="utf-8"))
    casts = [n for n in graph["nodes"] if n["op"] == "amp_cast" or n["name"].endswith(OUT_SUFFIX)]
    assert casts  # the islands' roundings are mixprec's own casts (mixprec_mxnet.bf16_rounding)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MXNet: "Cannot decide type ... data"
        plain = gluon.SymbolBlock.imports(
            str(tmp_path / "fp32-symbol.json"), ["data"], str(tmp_path / "fp32-0000.params")
        )
    np.testing.assert_array_equal(plain(x).asnumpy(), expected)
    converted = net(x)  # and the block itself runs its converted graph
    np.testing.assert_allclose(converted.asnumpy(), expected, rtol=5e-2, atol=5e-2)


def test_convert_model_casts_per_the_lists_and_keeps_the_params() -> None:
    data = mx.sym.var("data")
    fc = mx.sym.FullyConnected(data, num_hidden=4, name="fc")
    sym = mx.sym.softmax(fc, name="prob")
    args = {"fc_weight": mx.nd.ones((4, 3)), "fc_bias": mx.nd.zeros((4,))}
    converted, arg_params, aux_params = amp.convert_model(sym, args, {}, target_dtype="float16")
    assert arg_params is args and aux_params == {}
    dtypes = node_dtypes(converted, data="float32")
    assert dtypes["fc"] == "float16" and dtypes["prob"] == "float32"
    kept = amp.convert_symbol(sym, "float16", excluded_sym_names=["fc"])
    assert node_dtypes(kept, data="float32")["fc"] == "float32"
    ops = {node["op"] for node in json.loads(kept.tojson())["nodes"]}
    assert "FullyConnected" in ops
    with pytest.raises(WrapError, match="BucketingModule"):
        amp.convert_bucketing_module(object())


def test_op_lists_follow_the_policy() -> None:
    assert amp.list_fp16_ops is amp.list_lp16_ops
    lowp, fp32 = amp.list_lp16_ops("float16"), amp.list_fp32_ops("float16")
    widest = amp.list_widest_type_cast("float16")
    assert "FullyConnected" in lowp and "softmax" in fp32 and "elemwise_add" in widest
    assert not (set(lowp) & set(fp32)) and not (set(lowp) & set(widest))
    assert not set(amp.list_lp16_fp32_ops("float16")) & (set(lowp) | set(fp32))
    assert ("Activation", "act_type", ["softrelu"]) in amp.list_conditional_fp32_ops("float16")
    assert "SoftmaxOutput" in amp.list_loss_output_functions("bfloat16")
    assert amp.list_lp16_use_fp32_params("float16") is None

    policy = amp.init(
        target_dtype="bfloat16",
        target_precision_ops=["Deconvolution"],
        fp32_ops=["FullyConnected"],
        conditional_fp32_ops=[("Activation", "act_type", ["relu"])],
    )
    assert amp.current_policy() == policy and policy.compute == "bfloat16"
    assert policy.decide("relu").dtype == "float32"
    assert "FullyConnected" in amp.list_fp32_ops()  # init's lists, the current context
    assert "FullyConnected" not in amp.list_lp16_ops()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"target_dtype": "float64"}, "float16 or bfloat16"),
        ({"target_dtype": "bfloat16", "fp32_ops": ["FullyConected"]}, "FullyConnected"),
        ({"conditional_fp32_ops": [("Activation", "act_type", ["swish"])]}, "fp32_ops="),
        ({"target_dtype": "float16", "policy": "O1-bf16"}, "disagrees"),
        ({"policy": "O2-bf16", "fp32_ops": ["softmax"]}, "O1 policy"),
    ],
)
def test_bad_init_arguments_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyError, match=re.escape(message)):
        amp.init(**kwargs)
    assert amp.current_policy() is None


# ---------------------------------------------------------------------- the seed article


def _article_accuracy(source: str, tmp_path: Path, name: str) -> float:
    script = tmp_path / name
    script.write_text(source, encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-W", "ignore:no bfloat16 kernel", script],
        capture_output=True, text=True, timeout=600, cwd=ROOT, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return float(re.findall(r"Val Acc: ([0-9.]+)", proc.stdout)[-1])


@pytest.mark.slow
def test_seed_article_loop_with_the_mixprec_trainer_matches_float32(tmp_path: Path) -> None:
    source = ARTICLE.read_text(encoding="utf-8")
    assert source.count(MIXPREC_LINE) == 1
    float32 = _article_accuracy(
        source.replace(MIXPREC_LINE, ARTICLE_LINE), tmp_path, "article_fp32.py"
    )
    mixed = _article_accuracy(source, tmp_path, "article_mixprec.py")
    assert float32 > 0.93
    assert mixed >= float32 - 0.01


# ---------------------------------------------------------------------- docs/migration.md


def _migration_block(after: str) -> str:
    text = (ROOT / "docs" / "migration.md").read_text(encoding="utf-8")
    section = text[text.index("## From mxnet.contrib.amp") :]
    return section.split(after, 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.parametrize("policy", ["O1-bf16", "O2-bf16"])
def test_migration_clipping_recipe_clips_what_the_update_reads(policy: str) -> None:
    net = mlp()
    trainer = mpx.Trainer(net, "sgd", {"learning_rate": 1.0}, policy=policy)
    x, y = batch()
    before = {k: v.astype("float64") for k, v in values(net).items()}
    scope = {"net": net, "trainer": trainer, "x": x, "y": y, "batch_size": 1}
    scope |= {"loss_fn": gluon.loss.L2Loss(), "autograd": autograd, "gluon": gluon}
    scope["mixprec"] = sys.modules["mixprec"]
    exec(compile(_migration_block("**Clipping.**"), "migration.md#clipping", "exec"), scope)
    # lr 1 and batch size 1: the total update is the clipped gradient, of norm 1 at most
    moved = sum(float(((values(net)[k] - v) ** 2).sum()) for k, v in before.items())
    assert 0.5 < moved**0.5 <= 1.0 + 2e-2


def test_migration_drop_in_snippet_runs() -> None:
    net = mlp()
    scope = {"net": net, "gluon": gluon}
    exec(compile(_migration_block("Two routes."), "migration.md#drop-in", "exec"), scope)
    assert isinstance(scope["trainer"], mpx.Trainer)
    _step(net, scope["trainer"], *batch())
