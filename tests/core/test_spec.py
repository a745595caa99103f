"""The key grammar, dict and TOML forms of a policy, and the catalogue of bad specs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from _policy_cases import ALIASES, ALL_NAMES, BN, round_trips
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mixprec.engine.spec import get_policy, load_toml
from mixprec.errors import PolicyError
from mixprec.numerics.loss_scale import DynamicScale, NoScale, StaticScale
from mixprec.policy.ops import OP_FAMILIES
from mixprec.policy.value import ModuleRule, OpRules, Policy

pytestmark = pytest.mark.usefixtures("fresh_plugins")


# ---------------------------------------------------------------------- the key grammar


def test_key_grammar() -> None:
    policy = get_policy(
        "base=O2,compute=bfloat16,output=bfloat16,fp32+=softmax|exp,lowp+=linear,"
        "class:*LayerNorm*=float32,path:decoder.*.attn=(fp32=matmul,promote=add|mul),"
        "loss_scale=static:8"
    )
    expected = (
        get_policy("O2-bf16", output="bfloat16", loss_scale=StaticScale(8.0))
        .with_ops(fp32=["softmax", "exp"], lowp=["linear"])
        .with_module("*LayerNorm*", "float32")
        .with_module(
            "decoder.*.attn",
            match="path",
            ops={"matmul": "fp32", "add": "promote", "mul": "promote"},
        )
    )
    assert policy == expected
    round_trips(policy)


def test_jmp_style_spec_builds_on_auto() -> None:
    policy = get_policy("params=float32,compute=bfloat16,output=float32")
    assert policy == get_policy("O1-bf16")
    assert get_policy("O2,fp32+=softmax") == get_policy("O2").with_ops(fp32=["softmax"])


def test_grammar_exact_lists_and_dropping_modules() -> None:
    policy = get_policy("base=O1,fp32=softmax,modules=none,path:head=bfloat16")
    assert policy.ops.fp32 == {"softmax"} and policy.ops.list_of("exp") is None
    assert policy.modules == (ModuleRule("path", "head", "bfloat16"),)
    round_trips(policy)


def test_edited_policies_round_trip() -> None:
    o1 = get_policy("O1")
    cases = [
        o1.with_ops(fp32=["matmul", "torch:aten::addmm"], passthrough=["add"]),
        o1.with_module("*BatchNorm*", "bfloat16"),
        o1.with_module("*LayerNorm*", "float32").with_module(
            "enc.*", match="path", ops={"softmax": "lowp"}
        ),
        get_policy("O2").with_ops(lowp=["mxnet:FullyConnected"]),
        get_policy("O3-bf16", master="float32", reduce="float32"),
        Policy(**{**_fields(o1), "ops": OpRules(lowp=["linear"]), "modules": ()}),
        Policy(**{**_fields(o1), "modules": (ModuleRule("path", "x", "float32"), BN)}),
        get_policy("auto", output="bfloat16"),
    ]
    for policy in cases:
        round_trips(policy)


def _fields(policy: Policy) -> dict[str, Any]:
    return {
        k: getattr(policy, k)
        for k in ("param", "compute", "output", "master", "reduce", "loss_scale", "ops", "modules")
    }


def test_str_is_compact() -> None:
    assert str(get_policy("O1").with_ops(fp32=["matmul"])) == "base=O1,fp32+=matmul"
    assert str(get_policy("O2", loss_scale="static:128")) == "base=O2,loss_scale=static:128"
    assert str(get_policy("auto", compute="bfloat16")) == "O1-bf16"


# ---------------------------------------------------------------------- dict and TOML


def test_partial_dict_on_a_base() -> None:
    policy = Policy.from_dict(
        {
            "base": "O1",
            "compute": "bfloat16",
            "move_ops": {"fp32": ["matmul"]},
            "add_modules": [{"match": "path", "pattern": "head", "dtype": "float32"}],
            "loss_scale": "dynamic(init=1024)",
        }
    )
    expected = (
        get_policy("O1-bf16", loss_scale=DynamicScale(init=1024.0))
        .with_ops(fp32=["matmul"])
        .with_module("head", "float32", match="path")
    )
    assert policy == expected


def test_hand_written_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(
        'base = "O2-bf16"\nmaster = "none"\nparam = "float32"\n'
        '[loss_scale]\nkind = "dynamic"\ninit = 256.0\n'
        '[move_ops]\nfp32 = ["softmax", "torch:aten::addmm"]\n'
        '[[add_modules]]\nmatch = "path"\npattern = "decoder.*"\nops = { softmax = "lowp" }\n'
    )
    expected = (
        get_policy("O2-bf16", master=None, param="float32", loss_scale=DynamicScale(init=256.0))
        .with_ops(fp32=["softmax", "torch:aten::addmm"])
        .with_module("decoder.*", match="path", ops={"softmax": "lowp"})
    )
    assert load_toml(path) == expected
    assert get_policy(str(path)) == expected and get_policy(path) == expected


def test_to_toml_is_complete_and_commented() -> None:
    text = get_policy("O2").to_toml()
    assert text.startswith("# mixprec policy 'O2'")
    assert 'master = "float32"' in text and "[loss_scale]" in text and "[[modules]]" in text


# ---------------------------------------------------------------------- bad specs


@pytest.mark.parametrize(
    ("spec", "overrides", "expected"),
    [
        # unknown preset: close match and every valid name
        ("O2-bf61", {}, ["Did you mean 'O2-bf16'", "O0, O1, O2, O3, O1-bf16", "bf16-true", "auto"]),
        ("bf16mixed", {}, ["'bf16-mixed'", "16-true"]),
        # unknown dtype
        ("O1", {"compute": "bfloat61"}, ["unknown dtype 'bfloat61'", "'bfloat16'", "float8_e5m2"]),
        ("base=O1,output=fp61", {}, ["unknown dtype 'fp61'", "float32, float16, bfloat16"]),
        # unknown op
        (
            "base=O1,fp32+=softmx",
            {},
            ["unknown op 'softmx'", "Did you mean 'softmax'", "log_softmax"],
        ),
        # op in two lists
        (
            {"base": "O1", "ops": {"fp32": ["exp"], "lowp": ["exp"]}},
            {},
            ["'exp'", "'lowp'", "'fp32'"],
        ),
        # master with float32 params
        (
            "O1",
            {"master": "fp32"},
            ["master=float32 with param=float32 is pointless", "master=None"],
        ),
        ("base=O1,master=float32", {}, ["pointless"]),
        # bad loss scales
        (
            "O1",
            {"loss_scale": "dynamc"},
            ["bad loss_scale 'dynamc'", "none", "dynamic", "static:<scale>"],
        ),
        (
            "O1",
            {"loss_scale": "dynamic(inti=4)"},
            ["unknown dynamic loss-scale setting", "init", "hysteresis"],
        ),
        ("O1", {"loss_scale": "static:big"}, ["not a number"]),
        # a JSON integer past float's range (a hostile checkpoint header): no bare OverflowError
        (
            "O1",
            {"loss_scale": 10**400},
            ["StaticScale.scale must be a positive finite", "401 digits"],
        ),
        ("O1", {"loss_scale": "dynamic(interval=1.5)"}, ["not an integer"]),
        ("O1", {"loss_scale": "dynamic(growth=0.5)"}, ["growth must be >= 1"]),
        # bad grammar keys and items
        (
            "base=O1,compte=bfloat16",
            {},
            ["unknown key 'compte'", "Did you mean 'compute'", "class:<glob>"],
        ),
        ("base=O1,fp33+=exp", {}, ["unknown op list 'fp33'", "lowp", "passthrough", "banned"]),
        ("base=O1,bfloat16", {}, ["not key=value"]),
        ("base=O1,base=O2", {}, ["given twice"]),
        ("base=O1,modules=all", {}, ["only the value 'none'"]),
        ("base=O1,loss_scale=dynamic(init=2", {}, ["unbalanced '('"]),
        ("base=O1,class:X=", {}, ["needs a dtype to pin or ops"]),
        ("O1", {"computee": "float16"}, ["unknown policy field 'computee'", "compute"]),
        ({"base": "O1", "opps": {}}, {}, ["unknown policy keys ['opps']", "Did you mean 'ops'"]),
        (42, {}, ["preset name, a key-grammar string"]),
    ],
)
def test_bad_specs_raise_with_the_choices(
    spec: Any, overrides: dict[str, Any], expected: list[str]
) -> None:
    with pytest.raises(PolicyError) as err:
        get_policy(spec, **overrides)
    for fragment in expected:
        assert fragment in str(err.value)


def test_ambiguous_module_rule_names_both() -> None:
    policy = get_policy("base=O1,path:enc.*=float32,path:*.attn=bfloat16")
    with pytest.raises(PolicyError) as err:
        policy.decide("linear", ["float16"], module="enc.attn")
    assert "path:enc.*=float32 and path:*.attn=bfloat16" in str(err.value)


def test_bad_toml() -> None:
    with pytest.raises(PolicyError, match="not valid TOML"):
        load_toml("base = \n")
    with pytest.raises(PolicyError, match="cannot read policy file"):
        load_toml("missing/nowhere.toml")
    with pytest.raises(PolicyError, match="loss_scale table needs kind"):
        load_toml('base = "O1"\n[loss_scale]\ninit = 4.0\n')


# ---------------------------------------------------------------------- property test

_OPS = st.sampled_from([*OP_FAMILIES, "torch:aten::addmm", "mxnet:FullyConnected"])
_LISTS = st.sampled_from(["lowp", "fp32", "promote", "passthrough", "banned"])
_DTYPES = st.sampled_from(["float32", "float16", "bfloat16"])
_SCALES = st.one_of(
    st.just(NoScale()),
    st.builds(StaticScale, st.sampled_from([1.0, 128.0, 0.5, 3e5])),
    st.builds(
        DynamicScale,
        init=st.sampled_from([1024.0, 2.0**16]),
        growth=st.sampled_from([2.0, 1.5]),
        interval=st.integers(1, 5000),
        hysteresis=st.integers(1, 3),
        max=st.sampled_from([2.0**24, math.inf]),
        on_floor=st.sampled_from(["warn", "raise"]),
    ),
)
_PATTERNS = st.sampled_from(["*BatchNorm*", "*Norm*", "encoder.*", "head", "Linear"])
_RULE_OPS = st.dictionaries(_OPS, _LISTS, max_size=3)


@st.composite
def edited_policies(draw: st.DrawFn) -> Policy:
    policy = get_policy(draw(st.sampled_from(ALL_NAMES + list(ALIASES))))
    roles: dict[str, Any] = {}
    for role in ("compute", "param", "output", "reduce", "master", "loss_scale"):
        if draw(st.booleans()):
            if role == "loss_scale":
                roles[role] = draw(_SCALES)
            elif role == "master":
                roles[role] = draw(st.one_of(st.none(), st.just("float32")))
            else:
                roles[role] = draw(_DTYPES)
    try:
        policy = get_policy(policy, **roles)
    except PolicyError:
        pass  # an invalid combination (a pointless master): keep the preset
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["move", "replace", "module", "drop"]))
        if kind == "move":
            policy = policy.with_ops(
                **{draw(_LISTS): draw(st.lists(_OPS, max_size=3, unique=True))}
            )
        elif kind == "replace":
            ops = policy.ops.replaced(
                **{draw(_LISTS): draw(st.lists(_OPS, max_size=3, unique=True))}
            )
            policy = Policy(**{**_fields(policy), "ops": ops})
        elif kind == "module":
            ops = draw(_RULE_OPS)
            dtype = draw(_DTYPES if not ops else st.one_of(st.none(), _DTYPES))
            match = draw(st.sampled_from(["class", "path"]))
            policy = policy.with_module(draw(_PATTERNS), dtype, match=match, ops=ops)
        else:
            policy = Policy(**{**_fields(policy), "modules": policy.modules[1:]})
    return policy


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edited_policies())
def test_random_edits_round_trip(policy: Policy) -> None:
    round_trips(policy)


def test_module_rules_in_a_mapping_may_use_the_grammar_form() -> None:
    policy = Policy.from_dict(
        {"base": "O1", "add_modules": ["class:*LayerNorm*=float32(fp32=softmax|exp)"]}
    )
    expected = get_policy("O1").with_module(
        "*LayerNorm*", "float32", ops={"softmax": "fp32", "exp": "fp32"}
    )
    assert policy == expected


# ---------------------------------------------------------------------- issue 21: hostile files

HOSTILE = {
    "base is a number": ("base = 5\n", "'base' must be a string"),
    "kind is a list": ('[loss_scale]\nkind = ["dynamic"]\n', "bad loss_scale"),
    "a role is a number": ("compute = 5\n", "'compute' must be a string"),
    "name is a number": ("name = 5\n", "'name' must be a string"),
    "an op list is a number": ("[ops]\nfp32 = 5\n", "'ops' must map op lists"),
    "modules is a number": ("modules = 5\n", "'modules' must be a list"),
    "add_modules is a number": ("add_modules = 5\n", "'add_modules' must be a list"),
    "rule ops is a number": (
        '[[modules]]\nmatch = "class"\npattern = "X"\nops = 5\n',
        "bad module rule",
    ),
    "rule dtype is a list": (
        '[[modules]]\nmatch = "class"\npattern = "X"\ndtype = ["float32"]\n',
        "bad module rule",
    ),
    "an integer beyond float": (
        '[loss_scale]\nkind = "static"\nscale = 1' + "0" * 400 + "\n",
        "positive finite",
    ),
    "a float beyond float": ('[loss_scale]\nkind = "dynamic"\ninit = 1e400\n', "positive finite"),
    "deep nesting": ("ops = " + "[" * 5000 + "]" * 5000 + "\n", "nests .* too deeply"),
    "deep inline tables": (
        "ops = " + "{a = " * 3000 + "1" + "}" * 3000 + "\n",
        "nests .* too deeply",
    ),
    "a deep loss scale table": (
        "loss_scale = " + "[" * 50 + "]" * 50 + "\n",
        "bad loss_scale",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_policy_file_is_a_policy_error(tmp_path: Path, case: str) -> None:
    """AttributeError, TypeError, OverflowError and RecursionError escaped before."""
    text, message = HOSTILE[case]
    path = tmp_path / "hostile.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(PolicyError, match=message):
        get_policy(path)
    with pytest.raises(PolicyError, match=message):
        get_policy(str(path))


def test_a_file_that_is_no_utf8_text_is_a_policy_error(tmp_path: Path) -> None:
    path = tmp_path / "binary.toml"
    path.write_bytes(b"\xff\xfe base = 1")
    with pytest.raises(PolicyError, match="is not UTF-8 text"):
        get_policy(path)


def test_an_endless_file_is_read_only_up_to_the_limit(tmp_path: Path) -> None:
    """A policy path to /dev/zero was read without bound."""
    import mixprec.engine.spec

    endless = Path("/dev/zero")
    if not endless.exists():
        pytest.skip("no /dev/zero here")
    link = tmp_path / "zero.toml"
    link.symlink_to(endless)
    for spec in (endless, str(link)):
        with pytest.raises(PolicyError, match="larger than 1 MiB"):
            get_policy(spec)
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * (mixprec.engine.spec.MAX_POLICY_BYTES + 1))
    with pytest.raises(PolicyError, match="larger than"):
        get_policy(big)
    exact = tmp_path / "exact.toml"
    exact.write_bytes(b'base = "O1"\n' + b"#" * (mixprec.engine.spec.MAX_POLICY_BYTES - 13) + b"\n")
    assert get_policy(exact) == get_policy("O1")


def test_a_saved_policy_of_the_wrong_shape_is_a_policy_error() -> None:
    """Checkpoints carry Policy.to_dict(): Policy.from_dict checks its shape the same way."""
    good = get_policy("O2-bf16").to_dict()
    assert Policy.from_dict(good) == get_policy("O2-bf16")
    for key, value in [("base", 5), ("ops", {"fp32": "softmax"}), ("modules", [{"ops": 5}])]:
        with pytest.raises(PolicyError):
            Policy.from_dict({**good, key: value})
    with pytest.raises(PolicyError, match="table of named settings"):
        Policy.from_dict([("base", "O1")])  # type: ignore[arg-type]
    deep: Any = []
    for _ in range(10_000):
        deep = [deep]
    with pytest.raises(PolicyError, match=r"\[\[\[\.\.\.\]\]\]"):  # shown bounded, no recursion
        Policy.from_dict({"modules": deep})
