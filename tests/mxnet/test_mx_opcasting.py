"""O1 on Gluon: each op runs in the dtype ``policy.decide`` names (MXNet graph pass)."""

from __future__ import annotations

import warnings

import pytest

mx = pytest.importorskip("mxnet")

from _mx_nets import batch, bf16_computes, cnn  # noqa: E402
from mxnet import autograd, gluon, nd  # noqa: E402

from mixprec.errors import MixprecWarning, PolicyError, WrapError  # noqa: E402
from mixprec.kit import get_policy  # noqa: E402
from mixprec_mxnet.conformance import MXNetAdapter, run_op  # noqa: E402
from mixprec_mxnet.dtypes import dtype_of  # noqa: E402
from mixprec_mxnet.o1.graph import install_graph_pass, node_dtypes  # noqa: E402
from mixprec_mxnet.ops import amp_lists, family_of, supported_families  # noqa: E402

pytestmark = pytest.mark.mxnet

SUPPORTED = sorted(MXNetAdapter().supported_ops())
O1_BF16 = get_policy("O1-bf16")
ISLANDS = {"bfloat16": set(MXNetAdapter().fp32_islands("bfloat16"))}


def _by_list(policy, lst):
    return [op for op in SUPPORTED if policy.ops.list_of(op) == lst]


# Every supported family moved to every other list at least once.
EDITED = {
    "default": O1_BF16,
    "swapped": O1_BF16.with_ops(
        fp32=_by_list(O1_BF16, "lowp") + _by_list(O1_BF16, "promote"),
        lowp=_by_list(O1_BF16, "fp32") + _by_list(O1_BF16, "passthrough"),
    ),
    "promoted": O1_BF16.with_ops(
        promote=_by_list(O1_BF16, "lowp") + _by_list(O1_BF16, "fp32"),
        passthrough=_by_list(O1_BF16, "promote"),
    ),
}


def test_supported_families_cover_the_main_ops() -> None:
    assert {"linear", "conv", "softmax", "batch_norm", "add", "cat"} <= set(SUPPORTED)
    # no bfloat16 CPU kernel in MXNet 1.9: these cannot follow a low-precision rule
    assert not {"matmul", "bmm", "layer_norm", "dropout"} & supported_families("bfloat16", "cpu")


@pytest.mark.parametrize("input_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("edit", sorted(EDITED))
def test_each_family_runs_in_the_decided_dtype(edit: str, input_dtype: str) -> None:
    policy = EDITED[edit]
    wrong = {}
    for op in SUPPORTED:
        expected = policy.decide(op, (input_dtype,)).dtype
        if op in ISLANDS.get(expected, ()):  # no kernel in that dtype here: float32 island
            expected = "float32"
        got = run_op(policy, op, input_dtype)
        if got != expected:
            wrong[op] = (got, expected)
    assert not wrong, f"(ran in, decided) per op under {edit}: {wrong}"


@pytest.mark.cpu_isa
def test_o2_ops_pass_through() -> None:
    policy = get_policy("O2-bf16")
    for op in ("linear", "softmax", "add"):
        native = {"linear": "FullyConnected", "softmax": "softmax", "add": "elemwise_add"}[op]
        assert run_op(policy, op, "bfloat16") == bf16_computes(native)
        assert run_op(policy, op, "float32") == "float32"


def _converted(policy, net=None):
    net = net or cnn()
    install_graph_pass(net, policy, "cpu")
    x, _ = batch(image=True)
    with autograd.record():
        out = net(x)
    out.backward()
    return net, out, node_dtypes(net._cached_graph[1], data="float32")


@pytest.mark.cpu_isa
def test_o1_cnn_graph_follows_op_and_module_rules() -> None:
    net, out, dtypes = _converted(O1_BF16)
    conv, bn, dense = net[0], net[1], net[9]
    assert dtypes[conv.name + "_fwd"] == bf16_computes("Convolution")
    assert dtypes[dense.name + "_fwd"] == bf16_computes("FullyConnected")
    assert dtypes[bn.name + "_fwd"] == "float32"  # the *BatchNorm* class rule
    assert dtype_of(out) == "float32"  # output=float32
    assert dtype_of(conv.weight.data()) == dtype_of(conv.weight.grad()) == "float32"


@pytest.mark.cpu_isa
def test_module_rules_reach_nodes_inside_the_module() -> None:
    # batch_norm moved to lowp globally: the class rule still keeps BatchNorm in float32
    policy = O1_BF16.with_ops(lowp=["batch_norm"])
    net, _, dtypes = _converted(policy)
    assert dtypes[net[1].name + "_fwd"] == "float32"
    # a path rule keeps the first conv in float32; the second stays low precision
    policy = O1_BF16.with_module("0", "float32", match="path")
    net, _, dtypes = _converted(policy)
    assert dtypes[net[0].name + "_fwd"] == "float32"
    assert dtypes[net[3].name + "_fwd"] == bf16_computes("Convolution")


def test_module_rule_pinning_low_precision_is_refused() -> None:
    policy = O1_BF16.with_module("1", "bfloat16", match="path")
    with pytest.raises(WrapError, match="float32"):
        _converted(policy)


def test_banned_op_in_the_graph_raises_with_advice() -> None:
    policy = O1_BF16.with_ops(banned=["softmax"])
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(4, in_units=8))
    net.initialize()
    install_graph_pass(net, policy, "cpu")

    class Softmaxed(gluon.HybridBlock):
        def hybrid_forward(self, F, x):
            return F.softmax(x)

    net.add(Softmaxed())
    with pytest.raises(PolicyError, match="banned"):
        net(nd.ones((2, 8)))


def test_ops_without_bf16_kernels_run_in_float32_with_a_warning() -> None:
    class Matmul(gluon.HybridBlock):
        def hybrid_forward(self, F, x):
            return F.dot(x, x, transpose_b=True)

    net = Matmul()
    install_graph_pass(net, O1_BF16, "cpu")  # matmul is lowp, but dot has no bf16 CPU kernel
    with pytest.warns(MixprecWarning, match="dot"):
        out = net(nd.ones((2, 3)))
    dtypes = node_dtypes(net._cached_graph[1], data="float32")
    dot = [name for name in dtypes if name.startswith(net.name + "_dot")]
    assert dot and dtypes[dot[0]] == "float32"
    assert dtype_of(out) == "float32"


@pytest.mark.cpu_isa
def test_native_names_and_lists() -> None:
    assert family_of("Activation", {"act_type": "relu"}) == "relu"
    assert family_of("Activation", {"act_type": "softrelu"}) is None
    lists = amp_lists(O1_BF16.with_ops(fp32=["mxnet:Flatten", "sigmoid"]), "cpu")
    dense_list = lists.lowp if bf16_computes("FullyConnected") == "bfloat16" else lists.fp32
    assert "FullyConnected" in dense_list and "softmax" in lists.fp32
    assert "Flatten" in lists.fp32 and "Concat" in lists.widest
    assert lists.conditional[("Activation", "act_type")] >= {"sigmoid", "softrelu"}
    assert "Dropout" in lists.fp32  # no bf16 kernel, whatever dropout's rule


@pytest.mark.cpu_isa
def test_bf16_inputs_reach_float32_ops_cast() -> None:
    # MXNet's pass assumes graph inputs are float32; a bfloat16 input must still be cast
    assert run_op(O1_BF16, "softmax", "bfloat16") == "float32"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run_op(O1_BF16, "linear", "bfloat16") == bf16_computes("FullyConnected")


@pytest.mark.cpu_isa
def test_a_plain_block_gets_o1_on_its_hybrid_parts() -> None:
    from mixprec_mxnet import Trainer

    class Head(gluon.Block):  # not hybridizable: a plain Block around hybrid layers
        def __init__(self):
            super().__init__()
            self.body = cnn()

        def forward(self, x):
            return self.body(x) * 2

    net = Head()
    Trainer(net, "sgd", policy="O1-bf16")
    x, _ = batch(image=True)
    out = net(x)
    assert dtype_of(out) == "float32"
    dtypes = node_dtypes(net.body._cached_graph[1], data="float32")
    assert dtypes[net.body[0].name + "_fwd"] == bf16_computes("Convolution")


def test_untraceable_hybrid_block_gets_a_clear_error() -> None:
    class Untraceable(gluon.HybridBlock):
        def hybrid_forward(self, F, x):
            return x * float(x.sum().asscalar())  # needs values: cannot be traced

    net = Untraceable()
    install_graph_pass(net, O1_BF16, "cpu")
    with pytest.raises(WrapError, match="traced"):
        net(nd.ones((2, 3)))
