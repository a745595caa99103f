"""Policy: validation, op and module rules, decide() and explain()."""

from __future__ import annotations

from typing import Any

import pytest

from mixprec.engine.spec import get_policy
from mixprec.errors import PolicyError
from mixprec.numerics.loss_scale import DynamicScale, NoScale
from mixprec.policy.presets import default_op_rules, passthrough_op_rules
from mixprec.policy.value import Decision, ModuleRule, OpRules, Policy

O1 = get_policy("O1")
O2 = get_policy("O2")
O3_BF16 = get_policy("O3-bf16")


def make(**fields: Any) -> Policy:
    base: dict[str, Any] = dict(
        param="float32",
        compute="float16",
        output="float32",
        master=None,
        reduce="float32",
        loss_scale=NoScale(),
        ops=default_op_rules("float16"),
        modules=(),
    )
    base.update(fields)
    return Policy(**base)


# ---------------------------------------------------------------------- value semantics


def test_policy_is_frozen_hashable_and_compared_by_value() -> None:
    a = make(param="fp32", compute="half")
    b = make()
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a.param == "float32" and a.compute == "float16"  # aliases normalised
    with pytest.raises(AttributeError):
        a.param = "float16"  # type: ignore[misc]


def test_name_is_not_compared() -> None:
    assert make(name="mine") == make(name="other")


def test_running_loss_scale_state_is_reset() -> None:
    running = DynamicScale(init=1024.0).update(False).state
    assert running.good_steps == 1
    policy = make(loss_scale=running)
    assert policy.loss_scale == DynamicScale(init=1024.0)
    assert policy == make(loss_scale=DynamicScale(init=1024.0))


def test_module_list_is_stored_as_a_tuple() -> None:
    policy = make(modules=[ModuleRule("class", "*Norm*", "float32")])
    assert isinstance(policy.modules, tuple)
    hash(policy)


# ---------------------------------------------------------------------- validation


def test_master_equal_to_float32_params_is_refused() -> None:
    with pytest.raises(PolicyError, match=r"master=float32 with param=float32 is pointless"):
        make(master="float32")


def test_master_narrower_than_params_is_refused() -> None:
    with pytest.raises(PolicyError, match="narrower than param=float32"):
        make(param="float32", master="bfloat16")
    with pytest.raises(PolicyError, match="narrower"):
        make(param="bfloat16", master="float16")  # neither holds the other


def test_master_none_string_means_no_master() -> None:
    assert make(master="none").master is None


def test_unknown_role_dtype_is_refused() -> None:
    with pytest.raises(PolicyError, match=r"unknown dtype 'floot16'.*float16"):
        make(param="floot16")
    with pytest.raises(PolicyError, match="not a dtype a policy can use"):
        make(output="float64")


def test_loss_scaling_with_bfloat16_compute_is_allowed() -> None:
    assert make(compute="bfloat16", loss_scale=DynamicScale()).loss_scale == DynamicScale()


def test_loss_scale_must_be_a_loss_scale() -> None:
    with pytest.raises(PolicyError, match="get_policy"):
        make(loss_scale="dynamic")


def test_duplicate_module_pattern_is_refused() -> None:
    rules = (ModuleRule("class", "*Norm*", "float32"), ModuleRule("class", "*Norm*", "float16"))
    with pytest.raises(PolicyError, match=r"class:\*Norm\*=float32 and class:\*Norm\*=float16"):
        make(modules=rules)


# ---------------------------------------------------------------------- OpRules


def test_op_in_two_lists_is_refused_naming_both() -> None:
    with pytest.raises(PolicyError, match="'softmax' is in two lists, 'lowp' and 'fp32'"):
        OpRules(lowp=["softmax"], fp32=["softmax"])


def test_unknown_op_in_rules_is_refused() -> None:
    with pytest.raises(PolicyError, match="Did you mean 'matmul'"):
        OpRules(lowp=["matmull"])


def test_a_string_is_not_a_list_of_ops() -> None:
    with pytest.raises(PolicyError, match="not the string"):
        OpRules(fp32="softmax")


def test_edited_moves_ops_and_leaves_the_rest() -> None:
    rules = default_op_rules("float16").edited(fp32=["matmul"], lowp=["softmax"])
    assert rules.list_of("matmul") == "fp32" and rules.list_of("softmax") == "lowp"
    assert rules.list_of("exp") == "fp32" and rules.list_of("linear") == "lowp"
    with pytest.raises(PolicyError, match="given for two lists"):
        rules.edited(fp32=["exp"], lowp=["exp"])
    with pytest.raises(PolicyError, match="unknown op list 'fp16'"):
        rules.edited(fp16=["exp"])


def test_replaced_sets_lists_exactly() -> None:
    rules = default_op_rules("float16").replaced(fp32=["softmax", "linear"])
    assert rules.fp32 == {"softmax", "linear"}
    assert rules.list_of("linear") == "fp32" and rules.list_of("exp") is None


def test_prefixed_ops_can_be_listed() -> None:
    rules = OpRules(fp32=["torch:aten::addmm"])
    assert rules.list_of("torch:aten::addmm") == "fp32"


# ---------------------------------------------------------------------- ModuleRule


def test_module_rule_matching() -> None:
    bn = ModuleRule("class", "*BatchNorm*", "float32")
    assert bn.matches(None, "BatchNorm2d")
    assert bn.matches("x", ["MyNorm", "BatchNorm1d", "Module"])  # MRO
    assert not bn.matches("bn", "LayerNorm") and not bn.matches("bn", None)
    attn = ModuleRule("path", "encoder.*.attn", "float32")
    assert attn.matches("encoder.layers.0.attn", None)
    assert not attn.matches("decoder.0.attn", "Attention") and not attn.matches(None, "X")


def test_module_rule_validation() -> None:
    with pytest.raises(PolicyError, match=r"'class'.*'path'"):
        ModuleRule("name", "x", "float32")
    with pytest.raises(PolicyError, match="needs a dtype to pin or ops"):
        ModuleRule("class", "X")
    with pytest.raises(PolicyError, match="bad module-rule pattern"):
        ModuleRule("path", "a,b", "float32")
    with pytest.raises(PolicyError, match="unknown op list"):
        ModuleRule("path", "a", ops={"softmax": "fp16"})


def test_with_module_replaces_the_rule_for_the_same_pattern() -> None:
    policy = O1.with_module("*BatchNorm*", "bfloat16")
    assert policy.modules == (ModuleRule("class", "*BatchNorm*", "bfloat16"),)
    policy = policy.with_module("head", match="path", ops={"softmax": "lowp"})
    assert len(policy.modules) == 2 and policy.modules[1].ops == (("softmax", "lowp"),)


# ---------------------------------------------------------------------- decide


ENCODER = ModuleRule("path", "encoder.*", "float16", {"softmax": "fp32", "exp": "passthrough"})
NORMS = ModuleRule("class", "*Norm*", "float32", {"matmul": "lowp"})
EDITED = O1.with_module(ENCODER.pattern, ENCODER.dtype, match="path", ops=dict(ENCODER.ops))
EDITED = EDITED.with_module(NORMS.pattern, NORMS.dtype, ops=dict(NORMS.ops))


@pytest.mark.parametrize(
    ("policy", "op", "inputs", "module", "cls", "dtype", "source"),
    [
        # global lists under O1 (float16)
        (O1, "linear", ["float32"], None, None, "float16", "global"),
        (O1, "softmax", ["float16"], None, None, "float32", "global"),
        (O1, "add", ["float16", "float32"], None, None, "float32", "global"),
        (O1, "add", ["float16", "float16"], None, None, "float16", "global"),
        (O1, "cat", ["float16", "bfloat16"], None, None, "float32", "global"),
        (O1, "add", ["int64"], None, None, "float32", "global"),  # no float: param dtype
        (O1, "relu", ["float16"], None, None, "float16", "global"),
        (O1, "relu", ["int64", "bfloat16"], None, None, "bfloat16", "global"),
        (O1, "relu", [], None, None, "float32", "global"),
        (O1, "torch:aten::foo", ["float16"], None, None, "float16", "default"),
        # BatchNorm class rule pins float32 under O1 and O2
        (O1, "batch_norm", ["float16"], "bn", "BatchNorm2d", "float32", "module-class"),
        (O2, "linear", ["float16"], "bn", ["SyncBatchNorm", "Module"], "float32", "module-class"),
        (O2, "linear", ["float16"], "fc", "Linear", "float16", "global"),
        (O2, "softmax", ["float16"], None, None, "float16", "global"),  # O2: passthrough
        (O3_BF16, "layer_norm", ["bfloat16"], "ln", "LayerNorm", "bfloat16", "global"),
        # precedence: module op rule > path dtype > class dtype > global
        (EDITED, "softmax", ["float16"], "encoder.0", "LayerNorm", "float32", "module-op"),
        (EDITED, "exp", ["bfloat16"], "encoder.0", "Linear", "bfloat16", "module-op"),
        (EDITED, "exp", [], "encoder.0", "Linear", "float16", "module-op"),  # pinned param
        (EDITED, "linear", ["float32"], "encoder.0", "LayerNorm", "float16", "module-path"),
        (EDITED, "linear", ["float16"], "decoder.0", "LayerNorm", "float32", "module-class"),
        (EDITED, "matmul", ["float32"], "encoder.0", "LayerNorm", "float16", "module-op"),
        (EDITED, "matmul", ["float32"], "decoder.0", "Linear", "float16", "global"),
        (EDITED, "softmax", ["float16"], "decoder.0", "Linear", "float32", "global"),
    ],
)
def test_decide(
    policy: Policy,
    op: str,
    inputs: list[str],
    module: str | None,
    cls: Any,
    dtype: str,
    source: str,
) -> None:
    decision = policy.decide(op, inputs, module=module, module_class=cls)
    assert (decision.dtype, decision.source) == (dtype, source), decision.rule
    assert policy.decide(op, inputs, module=module, module_class=cls) is decision  # cached


def test_decision_names_the_rule() -> None:
    decision = EDITED.decide("softmax", ["float16"], "encoder.3", "Linear")
    assert decision == Decision(
        "float32",
        "path rule path:encoder.*=float16(fp32=softmax,passthrough=exp) (softmax in fp32)",
        "module-op",
    )
    assert O1.decide("softmax").rule == "global fp32 list"


def test_banned_op_raises_with_advice() -> None:
    with pytest.raises(PolicyError, match="binary_cross_entropy_with_logits"):
        O1.decide("binary_cross_entropy", ["float16"])
    # bfloat16 computes it in float32 instead
    assert get_policy("O1-bf16").decide("binary_cross_entropy", ["bfloat16"]).dtype == "float32"


def test_unknown_op_in_decide_raises() -> None:
    with pytest.raises(PolicyError, match="Did you mean 'softmax'"):
        O1.decide("softmaxx")


def test_two_path_rules_disagreeing_are_ambiguous() -> None:
    policy = O1.with_module("encoder.*", "float32", match="path")
    policy = policy.with_module("*.attn", "float16", match="path")
    with pytest.raises(PolicyError) as err:
        policy.decide("linear", ["float16"], module="encoder.attn")
    message = str(err.value)
    assert "ambiguous" in message
    assert "path:encoder.*=float32" in message and "path:*.attn=float16" in message
    with pytest.raises(PolicyError, match="ambiguous"):
        policy.module_dtype("encoder.attn", None)
    # where they agree, or only one matches, there is no ambiguity
    assert policy.decide("linear", [], module="encoder.fc").dtype == "float32"


def test_two_class_rules_disagreeing_on_an_op_are_ambiguous() -> None:
    policy = O1.with_module("*Norm*", ops={"softmax": "fp32"})
    policy = policy.with_module("Layer*", ops={"softmax": "lowp"})
    with pytest.raises(PolicyError, match=r"class:\*Norm\*=\(fp32=softmax\) and class:Layer\*"):
        policy.decide("softmax", ["float16"], module_class="LayerNorm")
    # a path rule's op rule outranks both: no ambiguity is consulted
    policy = policy.with_module("head", match="path", ops={"softmax": "fp32"})
    assert policy.decide("softmax", [], "head", "LayerNorm").source == "module-op"


def test_agreeing_rules_are_not_ambiguous() -> None:
    policy = O1.with_module("*Norm*", "float32").with_module("Batch*", "float32")
    assert policy.decide("linear", [], None, "BatchNorm1d").dtype == "float32"


def test_module_and_param_dtype() -> None:
    assert O2.module_dtype("features.bn1", "BatchNorm2d") == "float32"
    assert O2.param_dtype_for("features.bn1", "BatchNorm2d") == "float32"
    assert O2.module_dtype("fc", "Linear") is None
    assert O2.param_dtype_for("fc", "Linear") == "float16"
    pinned = O2.with_module("fc", "bfloat16", match="path")
    assert pinned.param_dtype_for("fc", "BatchNorm1d") == "bfloat16"  # path beats class


def test_auto_cannot_decide_until_resolved() -> None:
    with pytest.raises(PolicyError, match="resolve_auto"):
        get_policy("auto").decide("linear")


def test_decide_consults_the_rules_once_per_question(monkeypatch: pytest.MonkeyPatch) -> None:
    """Backends ask ``decide`` for every op they trace: repeats must come from the cache."""
    import mixprec.policy.value

    calls: list[tuple[Any, ...]] = []
    real = mixprec.policy.value.consult

    def counting(*args: Any) -> Any:
        calls.append(args[1:])
        return real(*args)

    monkeypatch.setattr(mixprec.policy.value, "consult", counting)
    policy = EDITED.with_ops(lowp=["gelu"])  # a fresh policy: an empty cache
    args = ("linear", ("float16",), "encoder.0.fc", ("Linear", "Module"))
    first = policy.decide(*args)
    assert [policy.decide(*args) for _ in range(3)] == [first] * 3
    assert len(calls) == 1
    policy.decide("linear", ("float32",), "encoder.0.fc", ("Linear", "Module"))
    assert len(calls) == 2  # a different question is consulted afresh


# ---------------------------------------------------------------------- facts


def test_facts() -> None:
    assert O1.casts_ops and not O2.casts_ops and not get_policy("O0").casts_ops
    assert O2.with_module("head", match="path", ops={"softmax": "fp32"}).casts_ops
    assert O2.uses_masters and not O1.uses_masters
    assert O1.is_resolved and not get_policy("auto").is_resolved


def test_with_ops_moves_ops_and_drops_the_preset_name() -> None:
    policy = O1.with_ops(fp32=["matmul"], passthrough=["add"])
    assert policy.ops.list_of("matmul") == "fp32" and policy.ops.list_of("add") == "passthrough"
    assert policy.name is None and O1.name == "O1"
    assert O2.with_ops(lowp=["linear"]).ops == passthrough_op_rules("float16").edited(
        lowp=["linear"]
    )


# ---------------------------------------------------------------------- explain


def test_explain_shows_the_chain_and_the_winner() -> None:
    text = EDITED.explain("linear", ["float32"], module="encoder.0", module_class="LayerNorm")
    lines = text.splitlines()
    assert lines[0].startswith("policy ") and "'linear'" in lines[0]
    assert "encoder.0" in lines[0] and "LayerNorm" in lines[0]
    assert "1. op rules inside path rules" in text
    assert "path:encoder.*=float16(fp32=softmax,passthrough=exp): matches, says nothing" in text
    assert "3. dtype pinned by path rules" in text and "-> float16  <- this step decides" in text
    assert "4. dtype pinned by class rules" in text
    assert text.count("(not reached: an earlier step decided)") == 2  # class pin, global
    assert (
        lines[-1]
        == "Result: float16, by path rule path:encoder.*=float16(fp32=softmax,passthrough=exp)"
    )
    decision = EDITED.decide("linear", ["float32"], module="encoder.0", module_class="LayerNorm")
    assert lines[-1].endswith(decision.rule)


def test_explain_reports_errors_instead_of_raising() -> None:
    text = O1.explain("binary_cross_entropy", ["float16"])
    assert "decide() raises PolicyError" in text
    assert text.splitlines()[-1].startswith("Result: error: op 'binary_cross_entropy' is banned")
    assert "not resolved" in get_policy("auto").explain("linear") or "resolves" in get_policy(
        "auto"
    ).explain("linear")


def test_policies_pickle_and_copy() -> None:
    import copy
    import pickle

    EDITED.decide("linear", ["float16"], "encoder.0", "Linear")  # a warm cache travels too
    for clone in (pickle.loads(pickle.dumps(EDITED)), copy.deepcopy(EDITED)):
        assert clone == EDITED and hash(clone) == hash(EDITED)
        assert clone.decide("softmax", [], "encoder.1").dtype == "float32"
