"""Rule precedence lives in one function, and every path that needs it fails the same way."""

from __future__ import annotations

import pytest

from mixprec.engine import diagnostics
from mixprec.engine.spec import get_policy
from mixprec.errors import PolicyError
from mixprec.policy.precedence import module_rule
from mixprec.policy.rules import ModuleRule

BASE = get_policy("O1-bf16")
# Both class rules match a LayerNorm and disagree: ambiguous, whichever path asks.
PIN_CLASH = BASE.with_module("*Norm*", "float32").with_module("Layer*", "bfloat16")
OP_CLASH = BASE.with_module("*Norm*", ops={"softmax": "fp32"}).with_module(
    "Layer*", ops={"softmax": "lowp"}
)
WHERE = ("enc.ln", ("LayerNorm",))


def shared_error(policy_rules: tuple[ModuleRule, ...], says: object) -> str:
    with pytest.raises(PolicyError, match="ambiguous module rules") as err:
        module_rule(policy_rules, *WHERE, says)  # type: ignore[arg-type]
    return str(err.value)


def test_path_rules_decide_before_class_rules() -> None:
    rules = (ModuleRule("class", "*Norm*", "float32"), ModuleRule("path", "enc.*", "bfloat16"))
    found = module_rule(rules, *WHERE, lambda rule: rule.dtype)
    assert found == (rules[1], "bfloat16")
    assert module_rule(rules, "dec.ln", ("LayerNorm",), lambda r: r.dtype) == (rules[0], "float32")
    assert module_rule(rules, "dec.fc", ("Linear",), lambda r: r.dtype) is None


def test_rules_that_say_nothing_do_not_decide() -> None:
    # the path rule says nothing about dtypes, so the class rule's pin decides; the class
    # rule says nothing about softmax, so the path rule's op rule decides
    path = ModuleRule("path", "enc.*", ops={"softmax": "fp32"})
    pin = ModuleRule("class", "*Norm*", "bfloat16")
    assert module_rule((path, pin), *WHERE, lambda rule: rule.dtype) == (pin, "bfloat16")
    found = module_rule((path, pin), *WHERE, lambda rule: rule.op_list("softmax"))
    assert found == (path, "fp32")


def test_agreeing_rules_are_not_ambiguous() -> None:
    policy = BASE.with_module("*Norm*", "float32").with_module("Layer*", "float32")
    assert policy.module_dtype(*WHERE) == "float32"
    assert policy.decide("linear", ["float32"], *WHERE).dtype == "float32"


def test_a_pin_clash_fails_the_same_way_in_decide_and_in_diagnostics() -> None:
    expected = shared_error(PIN_CLASH.modules, lambda rule: rule.dtype)
    with pytest.raises(PolicyError) as by_decide:
        PIN_CLASH.decide("linear", ["float32"], *WHERE)
    with pytest.raises(PolicyError) as by_pinning_rule:
        diagnostics.pinning_rule(PIN_CLASH, *WHERE)
    with pytest.raises(PolicyError) as by_report:
        diagnostics.dtype_rows(PIN_CLASH, [(WHERE[0], WHERE[1], "float32")])
    assert str(by_decide.value) == str(by_pinning_rule.value) == str(by_report.value) == expected


def test_an_op_rule_clash_fails_the_same_way_in_decide_and_in_the_mxnet_graph_pass() -> None:
    expected = shared_error(OP_CLASH.modules, lambda rule: rule.op_list("softmax"))
    with pytest.raises(PolicyError) as by_decide:
        OP_CLASH.decide("softmax", ["bfloat16"], *WHERE)
    assert str(by_decide.value) == expected
    pytest.importorskip("mxnet")
    from mixprec_mxnet.o1 import graph

    with pytest.raises(PolicyError) as by_graph:
        graph._module_list(OP_CLASH, "softmax", *WHERE)
    assert str(by_graph.value) == expected
    # and without the clash the graph pass reads the same winner as decide
    one = BASE.with_module("*Norm*", ops={"softmax": "fp32"})
    assert graph._module_list(one, "softmax", *WHERE) == "fp32"
    assert one.decide("softmax", ["bfloat16"], *WHERE).dtype == "float32"


def test_the_ambiguity_message_names_both_rules_and_the_fix() -> None:
    message = shared_error(PIN_CLASH.modules, lambda rule: rule.dtype)
    assert "*Norm*" in message and "Layer*" in message and "disjoint" in message
