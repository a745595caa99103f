"""Presets, aliases, overrides to get_policy, resolve_auto and plugin presets."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
from _policy_cases import ALIASES, ALL_NAMES, BN, round_trips

import mixprec
from mixprec.engine import plugins
from mixprec.engine.hookspecs import hookimpl
from mixprec.engine.spec import get_policy, preset_names
from mixprec.errors import MixprecWarning, PolicyError
from mixprec.numerics.loss_scale import DynamicScale, NoScale, StaticScale
from mixprec.policy.ops import OP_FAMILIES
from mixprec.policy.presets import default_op_rules, passthrough_op_rules, resolve_auto
from mixprec.policy.value import ModuleRule, Policy

pytestmark = pytest.mark.usefixtures("fresh_plugins")


# ---------------------------------------------------------------------- the preset table


@pytest.mark.parametrize("lowp", ["float16", "bfloat16"])
def test_preset_table(lowp: str) -> None:
    suffix = "" if lowp == "float16" else "-bf16"
    dynamic = DynamicScale() if lowp == "float16" else NoScale()
    o1, o2, o3 = (get_policy(f"O{n}{suffix}") for n in (1, 2, 3))
    assert (o1.param, o1.compute, o1.output, o1.master) == ("float32", lowp, "float32", None)
    assert o1.ops == default_op_rules(lowp) and o1.modules == (BN,) and o1.loss_scale == dynamic
    assert (o2.param, o2.compute, o2.output, o2.master) == (lowp, lowp, "float32", "float32")
    assert o2.ops == passthrough_op_rules(lowp) and o2.modules == (BN,) and o2.loss_scale == dynamic
    assert not (o2.ops.lowp or o2.ops.fp32 or o2.ops.promote)
    assert o2.ops.banned == default_op_rules(lowp).banned
    assert (o3.param, o3.compute, o3.output, o3.master) == (lowp, lowp, lowp, None)
    assert o3.modules == () and o3.loss_scale == NoScale()
    assert (o1.reduce, o2.reduce, o3.reduce) == ("float32", "float32", lowp)


def test_o0_and_auto() -> None:
    o0 = get_policy("O0")
    assert {o0.param, o0.compute, o0.output, o0.reduce} == {"float32"}
    assert o0.master is None and o0.loss_scale == NoScale() and not o0.casts_ops
    auto = get_policy()
    assert auto == get_policy(None) == get_policy("auto")
    assert auto.compute == "auto" and auto.modules == (BN,) and not auto.is_resolved


@pytest.mark.parametrize(("alias", "target"), ALIASES.items())
def test_aliases(alias: str, target: str) -> None:
    assert get_policy(alias) == get_policy(target)
    assert get_policy(alias).name == alias and str(get_policy(alias)) == alias


def test_names_are_case_insensitive() -> None:
    assert get_policy("o2-BF16") == get_policy("O2-bf16")
    assert get_policy("o2-BF16").name == "O2-bf16"


def test_preset_names() -> None:
    assert preset_names()[: len(ALL_NAMES) + len(ALIASES)] == ALL_NAMES + list(ALIASES)


@pytest.mark.parametrize("name", ALL_NAMES + list(ALIASES))
def test_every_preset_and_alias_round_trips(name: str) -> None:
    policy = get_policy(name)
    assert str(policy) == name
    round_trips(policy)


def test_lazy_reexports_match() -> None:
    assert mixprec.get_policy is get_policy and mixprec.Policy is Policy
    assert mixprec.OP_FAMILIES is OP_FAMILIES and mixprec.ModuleRule is ModuleRule
    for name in ("load_toml", "preset_names", "resolve_auto", "OpRules", "Decision",
                 "canonical_dtype", "format_info", "FormatInfo"):  # fmt: skip
        assert getattr(mixprec, name) is not None


# ---------------------------------------------------------------------- overrides


def test_overrides_apply_with_validation() -> None:
    policy = get_policy("O1", compute="bf16", output="bfloat16")
    assert (policy.compute, policy.output) == ("bfloat16", "bfloat16")
    assert get_policy("O1", params="float32") == get_policy("O1")
    with pytest.raises(PolicyError, match="pointless"):
        get_policy("O1", master="float32")


def test_changing_compute_re_derives_unedited_defaults() -> None:
    for level in ("O1", "O2", "O3"):
        assert get_policy(f"{level}-bf16", compute="float16") == get_policy(level)
        assert get_policy(level, compute="bfloat16") == get_policy(f"{level}-bf16")
    assert get_policy("auto", compute="bfloat16") == get_policy("O1-bf16")


def test_changing_compute_keeps_edited_ops_and_set_fields() -> None:
    edited = get_policy("O1").with_ops(fp32=["matmul"])
    moved = get_policy(edited, compute="bfloat16")
    assert moved.ops == edited.ops and moved.loss_scale == NoScale()
    assert get_policy("O1", compute="bfloat16", loss_scale="dynamic").loss_scale == DynamicScale()
    assert get_policy("O2", compute="bfloat16", param="float16").param == "float16"


def test_loss_scale_follows_masters_when_it_was_the_default() -> None:
    assert get_policy("O3", master="float32").loss_scale == DynamicScale()
    assert get_policy("O3", master="float32", loss_scale="none").loss_scale == NoScale()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("none", NoScale()),
        ("dynamic", DynamicScale()),
        ("static:1024", StaticScale(1024.0)),
        ("128", StaticScale(128.0)),
        (
            "dynamic(init=1024,interval=100,hysteresis=2,min=1,max=65536,growth=2,backoff=0.5,"
            "on_floor=raise)",
            DynamicScale(1024.0, 2.0, 0.5, 100, 2, 1.0, 65536.0, "raise"),
        ),
        ("dynamic(max=inf, growth=4.5)", DynamicScale(max=math.inf, growth=4.5)),
    ],
)
def test_loss_scale_grammar(text: str, expected: Any) -> None:
    policy = get_policy("O1", loss_scale=text)
    assert policy.loss_scale == expected
    round_trips(policy)
    assert get_policy(f"base=O1,loss_scale={text}") == policy


def test_every_dynamic_field_round_trips() -> None:
    changed = dict(init=512.0, growth=3.0, backoff=0.25, interval=7, hysteresis=3, min=2.0,
                   max=2.0**20, on_floor="raise")  # fmt: skip
    for key, value in changed.items():
        policy = get_policy("O1", loss_scale=DynamicScale(**{key: value}))
        assert f"{key}=" in str(policy)
        round_trips(policy)
    round_trips(get_policy("O1", loss_scale=DynamicScale(**changed)))  # type: ignore[arg-type]


# ---------------------------------------------------------------------- resolve_auto


@pytest.mark.parametrize(("lowp", "expected"), [("bfloat16", "O1-bf16"), ("fp16", "O1")])
def test_resolve_auto(lowp: str, expected: str) -> None:
    resolved = resolve_auto(get_policy("auto"), lowp)
    assert resolved == get_policy(expected) and resolved.name == expected
    assert resolved.loss_scale == (DynamicScale() if expected == "O1" else NoScale())


def test_resolve_auto_without_fast_lowp_warns_once_and_gives_o0() -> None:
    with pytest.warns(MixprecWarning, match="float32") as record:
        resolved = resolve_auto(get_policy("auto"), None)
    assert len(record) == 1 and resolved == get_policy("O0")


def test_resolving_a_resolved_policy_is_a_no_op() -> None:
    o2 = get_policy("O2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_auto(o2, None) is o2 and resolve_auto(o2, "bfloat16") is o2


def test_resolve_auto_keeps_edits() -> None:
    edited = get_policy("auto").with_ops(fp32=["matmul"])
    resolved = resolve_auto(edited, "bfloat16")
    assert resolved.compute == "bfloat16" and resolved.ops.list_of("matmul") == "fp32"
    with pytest.raises(PolicyError, match="low-precision"):
        resolve_auto(edited, "float32")


# ---------------------------------------------------------------------- plugin presets


class PresetPlugin:
    @hookimpl
    def mixprec_presets(self) -> dict[str, Any]:
        return {
            "my-preset": get_policy("O1").with_ops(fp32=["matmul"]),
            "my-dict": {"base": "O2", "output": "float16"},
        }


def test_plugin_presets() -> None:
    plugins.register(PresetPlugin(), name="preset-plugin")
    assert "my-preset" in preset_names() and "my-dict" in preset_names()
    mine = get_policy("my-preset")
    assert mine == get_policy("O1").with_ops(fp32=["matmul"]) and mine.name == "my-preset"
    assert get_policy("my-dict") == get_policy("O2", output="float16")
    with pytest.raises(PolicyError, match="my-preset"):
        get_policy("my-prest")
    # a partial mapping on a plugin's preset: get_policy reads it (it loads plugins);
    # Policy.from_dict, which sits below the plugins, says so instead of guessing
    partial = {"base": "my-preset", "output": "float16"}
    assert get_policy(partial) == get_policy("my-preset", output="float16")
    with pytest.raises(PolicyError, match=r"built-in presets .*get_policy\(mapping\)"):
        Policy.from_dict(partial)
    assert Policy.from_dict(mine.to_dict()) == mine  # the full form needs no base
