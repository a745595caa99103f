"""mixprec.engine.visibility: rules on ops a backend cannot see are refused or reported."""

from __future__ import annotations

import pytest

from mixprec.backend import Capabilities, DeviceCapability, UnseenOp
from mixprec.cli import main
from mixprec.engine.spec import get_policy
from mixprec.engine.visibility import check_rules_visible, refused_rules, unseen_notes
from mixprec.errors import PluginError, PolicyError

CAPS = Capabilities(
    "functional",
    "1.0",
    (DeviceCapability("cpu", ("float32", "bfloat16")),),
    unseen_ops=(
        UnseenOp("add", "promote", "operators"),
        UnseenOp("mul", "promote", "operators"),
        UnseenOp("nll_loss", "absent", "no such function"),
    ),
)


@pytest.mark.parametrize("preset", ["O0", "O1", "O1-bf16", "O2", "O2-bf16", "O3-bf16-kahan"])
def test_every_preset_is_honoured(preset: str) -> None:
    check_rules_visible(get_policy(preset), CAPS)


def test_a_casting_rule_on_an_unseen_op_is_refused_naming_it() -> None:
    policy = get_policy("O1-bf16").with_ops(fp32=["add"])
    with pytest.raises(PolicyError, match=r"puts 'add' in fp32.*cannot see 'add' \(operators\)"):
        check_rules_visible(policy, CAPS)
    in_module = get_policy("O2").with_module("enc.*", match="path", ops={"mul": "lowp"})
    assert refused_rules(in_module, CAPS) == [
        "module rule path:enc.* puts 'mul' in lowp, but the functional backend cannot see "
        "'mul' (operators): it would run as promote"
    ]
    # an op the framework does not have: a rule on it has nothing to act on, not refused
    check_rules_visible(get_policy("O1").with_ops(lowp=["nll_loss"]), CAPS)


def test_notes_say_which_rules_are_only_the_frameworks_behaviour() -> None:
    assert unseen_notes(get_policy("O1-bf16"), CAPS) == [
        "nll_loss: functional has no such op, so fp32 (the policy) has nothing to act on "
        "(no such function)"
    ]
    notes = unseen_notes(get_policy("O2-bf16"), CAPS)  # no op lists: add passes through
    assert notes == [
        "add, mul: passthrough by the policy, but functional cannot see it and runs it as "
        "promote (the same dtype whenever its inputs share one) (operators)"
    ]
    banned = get_policy("O1-bf16").with_ops(banned=["add"])
    assert (
        "banned by the policy, but functional cannot see it"
        in unseen_notes(banned, CAPS, ["add"])[0]
    )


def test_unseen_op_declares_a_known_native_behaviour() -> None:
    with pytest.raises(PluginError, match="native must be one of"):
        UnseenOp("add", "autocast")
    assert CAPS.unseen("add") == UnseenOp("add", "promote", "operators")
    assert CAPS.unseen("linear") is None


def test_explain_with_a_backend_says_whether_it_applies_the_rule(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("mixprec_numpy")
    assert main(["explain", "O1-bf16", "linear", "--backend", "numpy"]) == 0
    assert (
        capsys.readouterr()
        .out.rstrip()
        .endswith("numpy: applies this rule (linear asks the policy)")
    )
