"""The neutral op vocabulary and the default op lists."""

from __future__ import annotations

import pytest

from mixprec.errors import PolicyError
from mixprec.policy.ops import OP_FAMILIES, ban_advice, check_op_name
from mixprec.policy.presets import default_op_rules, passthrough_op_rules

LOWP = {"linear", "matmul", "bmm", "conv", "conv_transpose", "attention", "rnn_cell"}
FP32 = {
    "softmax", "log_softmax", "exp", "log", "pow", "layer_norm", "group_norm", "batch_norm",
    "instance_norm", "norm", "sum", "prod", "cumsum", "logsumexp", "cross_entropy",
    "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "kl_div",
    "binary_cross_entropy_with_logits",
}  # fmt: skip
PROMOTE = {"add", "sub", "mul", "div", "cat", "stack", "addcmul", "addcdiv", "where"}
PASSTHROUGH = {
    "relu", "gelu", "silu", "sigmoid", "tanh", "dropout", "max_pool", "avg_pool", "embedding",
}  # fmt: skip


def test_vocabulary_is_exactly_the_documented_families() -> None:
    assert len(OP_FAMILIES) == len(set(OP_FAMILIES))
    assert set(OP_FAMILIES) == LOWP | FP32 | PROMOTE | PASSTHROUGH | {"binary_cross_entropy"}


def test_float16_defaults() -> None:
    rules = default_op_rules("float16")
    assert rules.lowp == LOWP
    assert rules.fp32 == FP32
    assert rules.promote == PROMOTE
    assert rules.passthrough == PASSTHROUGH
    assert rules.banned == {"binary_cross_entropy"}


def test_bfloat16_defaults_keep_fewer_ops_in_float32() -> None:
    rules = default_op_rules("bf16")
    assert rules.lowp == LOWP and rules.promote == PROMOTE
    assert rules.list_of("pow") == rules.list_of("prod") == "passthrough"
    assert rules.fp32 == (FP32 - {"pow", "prod"}) | {"binary_cross_entropy"}
    assert rules.banned == frozenset()


def test_auto_and_float8_get_the_conservative_float16_lists() -> None:
    assert default_op_rules("auto") == default_op_rules("float16")
    assert default_op_rules("float8_e4m3fn") == default_op_rules("float16")


def test_passthrough_lists_keep_only_the_ban() -> None:
    rules = passthrough_op_rules("float16")
    assert rules.banned == {"binary_cross_entropy"}
    assert rules.passthrough == set(OP_FAMILIES) - {"binary_cross_entropy"}
    assert not (rules.lowp or rules.fp32 or rules.promote)
    assert passthrough_op_rules("bfloat16").passthrough == set(OP_FAMILIES)


def test_every_family_is_in_a_default_list() -> None:
    for compute in ("float16", "bfloat16", "float32"):
        rules = default_op_rules(compute)
        assert all(rules.list_of(op) is not None for op in OP_FAMILIES)


def test_unknown_op_gives_close_matches_and_the_vocabulary() -> None:
    with pytest.raises(PolicyError) as err:
        check_op_name("softmx")
    message = str(err.value)
    assert "Did you mean 'softmax'" in message
    assert "log_softmax" in message and "embedding" in message  # full vocabulary
    assert "torch:aten::addmm" in message  # how to name a native op


@pytest.mark.parametrize(
    "name",
    ["torch:aten::addmm", "mxnet:FullyConnected", "torch:aten::add.Tensor", "jax:dot_general"],
)
def test_backend_prefixed_names_are_accepted_as_is(name: str) -> None:
    assert check_op_name(name) == name


@pytest.mark.parametrize("name", ["torch:", ":addmm", "torch:a b", "torch:x|y", "to rch:addmm"])
def test_malformed_prefixed_names_are_rejected(name: str) -> None:
    with pytest.raises(PolicyError, match=r"backend op name|unknown op"):
        check_op_name(name)


def test_ban_advice() -> None:
    assert "binary_cross_entropy_with_logits" in ban_advice("binary_cross_entropy")
    assert "with_ops(fp32=['exp'])" in ban_advice("exp")
