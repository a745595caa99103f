"""FP8 in the core: the policy item, its text forms, the scalar arithmetic, the delayed
state machine and the what-if statistics, against independent references."""

from __future__ import annotations

import json
import math
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mixprec
from mixprec.backend import Capabilities, DeviceCapability
from mixprec.engine.spec import resolve_for_device
from mixprec.errors import CheckpointError, PolicyError, UnsupportedDtypeError
from mixprec.numerics.fp8.recipes import (
    FP8_RECIPES,
    FP8Recipe,
    fp8_recipe,
    mx_exponent,
    round_to_format,
    tensor_scale,
)
from mixprec.numerics.fp8.scaling import DelayedScaling
from mixprec.numerics.fp8.stats import FP8Statistics, Thresholds

# ------------------------------------------------------------------------------- the policy


@pytest.mark.parametrize(
    ("spec", "base", "recipe"),
    [
        ("O1-fp8", "O1-bf16", "tensorwise"),
        ("O2-fp8", "O2-bf16", "tensorwise"),
        ("O1-bf16,fp8=rowwise", "O1-bf16", "rowwise"),
        ("O1,fp8=mxfp8", "O1", "mxfp8"),  # a float16 base works too
        ("O2-bf16,fp8=delayed(history=32,margin=2)", "O2-bf16", "delayed(history=32,margin=2)"),
    ],
)
def test_fp8_is_an_item_on_a_base_policy(spec: str, base: str, recipe: str) -> None:
    policy = mixprec.get_policy(spec)
    assert str(policy.fp8) == recipe
    without = mixprec.Policy.from_dict({**policy.to_dict(), "fp8": None})
    assert without == mixprec.get_policy(base)
    # every text form round-trips, fp8 included
    assert mixprec.get_policy(str(policy)) == policy
    assert mixprec.Policy.from_dict(json.loads(json.dumps(policy.to_dict()))) == policy
    assert mixprec.load_toml(policy.to_toml()) == policy
    # the other op families keep the base's rules
    assert policy.decide("softmax", ("bfloat16",)) == mixprec.get_policy(base).decide(
        "softmax", ("bfloat16",)
    )


def test_presets_and_overrides() -> None:
    assert mixprec.get_policy("O1-fp8").name == "O1-fp8"
    assert str(mixprec.get_policy("O1-bf16,fp8=tensorwise")) == "O1-fp8"
    assert mixprec.get_policy("O1-bf16", fp8="tensorwise") == mixprec.get_policy("O1-fp8")
    assert mixprec.get_policy("O1-fp8", fp8=None) == mixprec.get_policy("O1-bf16")
    assert mixprec.get_policy("O1-fp8", fp8="none") == mixprec.get_policy("O1-bf16")
    # a float16 base keeps its loss scale
    assert (
        mixprec.get_policy("O1-fp8", compute="float16").loss_scale
        == mixprec.get_policy("O1").loss_scale
    )
    assert "O1-fp8" in mixprec.preset_names() and "O2-fp8" in mixprec.preset_names()


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("O0,fp8=tensorwise", ["float32", "O1-fp8", "tensorwise, rowwise, delayed, mxfp8"]),
        ("O3-bf16,compute=float32,fp8=rowwise", ["float32"]),
        ("O1-bf16,fp8=tensorwize", ["Did you mean 'tensorwise'"]),
        ("O1-bf16,fp8=delayed(history=0)", ["history", "1 to 1024"]),
        ("O1-bf16,fp8=delayed(margin=-1)", ["margin"]),
        ("O1-bf16,fp8=delayed(history=2,history=3)", ["repeated"]),
        ("O1-bf16,fp8=delayed(width=3)", ["unknown fp8 setting"]),
        ("O1-bf16,fp8=mxfp8(history=4)", ["takes no settings"]),
        ("O1-bf16,fp8=delayed(history=" + "9" * 400 + ")", ["too long"]),
        ("auto,fp8=tensorwise", ["auto", "O1-fp8"]),
    ],
)
def test_bad_fp8_items_name_the_recipes_and_the_fix(spec: str, words: list[str]) -> None:
    with pytest.raises(PolicyError) as err:
        mixprec.get_policy(spec)
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize("value", [3, 1.5, ["tensorwise"], {"recipe": "delayed"}, b"x", True])
def test_hostile_fp8_values_in_a_mapping_are_refused(value: object) -> None:
    with pytest.raises(PolicyError, match="fp8 must be a string"):
        mixprec.get_policy({"base": "O1-bf16", "fp8": value})


def test_explain_says_float8_and_the_recipe() -> None:
    text = mixprec.get_policy("O1-fp8").explain("linear")
    assert "float8_e4m3fn" in text and "float8_e5m2" in text and "tensorwise" in text
    assert "FP8" not in mixprec.get_policy("O1-fp8").explain("softmax")
    assert "FP8" not in mixprec.get_policy("O1-bf16").explain("linear")


def test_fp8_for_follows_the_rules() -> None:
    policy = mixprec.get_policy("O2-fp8,path:head=bfloat16,class:Proj=(fp32=linear)")
    assert policy.fp8_for("encoder.fc", "Linear") == FP8Recipe("tensorwise")
    assert policy.fp8_for("head", "Linear") is None
    assert policy.fp8_for("encoder.proj", ("Proj", "Linear")) is None
    assert mixprec.get_policy("O1-fp8,fp32+=linear").fp8_for("x", "Linear") is None
    assert mixprec.get_policy("O1-bf16").fp8_for("x", "Linear") is None


def test_a_device_without_the_recipe_refuses_it_before_the_backend_runs() -> None:
    caps = Capabilities(
        "x", "1", (DeviceCapability("cpu", ("float32", "bfloat16"), fp8_recipes=("tensorwise",)),)
    )
    assert resolve_for_device("O1-fp8", "x", "cpu", caps).fp8 == FP8Recipe("tensorwise")
    checked: list[object] = []
    with pytest.raises(UnsupportedDtypeError, match="tensorwise") as err:
        resolve_for_device("O1-fp8,fp8=mxfp8", "x", "cpu", caps, check=checked.append)
    assert "mxfp8" in str(err.value) and not checked
    bare = Capabilities("x", "1", (DeviceCapability("cpu", ("float32", "bfloat16")),))
    with pytest.raises(UnsupportedDtypeError, match="'O2-bf16'"):
        resolve_for_device("O2-fp8", "x", "cpu", bare)


# ------------------------------------------------------------------------------- arithmetic


def _f32(x: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


def _grid(fmt: str) -> list[float]:
    """Every finite value of the format, from its bit patterns (an independent reference)."""
    exp_bits, man_bits = (4, 3) if fmt == "float8_e4m3fn" else (5, 2)
    bias = 2 ** (exp_bits - 1) - 1
    values = []
    for e in range(2**exp_bits):
        for m in range(2**man_bits):
            if fmt == "float8_e4m3fn" and e == 15 and m == 7:
                continue  # NaN
            if fmt == "float8_e5m2" and e == 31:
                continue  # inf and NaN
            value = (
                (m / 2**man_bits) * 2.0 ** (1 - bias)
                if e == 0
                else (1 + m / 2**man_bits) * 2.0 ** (e - bias)
            )
            values.append(value)
    return sorted(set(values))


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
@settings(max_examples=400, deadline=None)
@given(x=st.floats(allow_nan=False, allow_infinity=False, width=32))
def test_rounding_is_to_the_nearest_grid_value_ties_to_even(fmt: str, x: float) -> None:
    grid = _grid(fmt)
    size = abs(x)
    got = round_to_format(x, fmt)
    if size >= grid[-1]:
        assert got == math.copysign(grid[-1], x)  # saturates
        return
    above = next(v for v in grid if v >= size)
    below = max(v for v in grid if v <= size)
    if above - size < size - below:
        want = above
    elif size - below < above - size:
        want = below
    else:  # a tie: the even mantissa (the one whose index on the grid is even)
        want = above if grid.index(above) % 2 == 0 else below
    assert abs(got) == want and (got == 0 or math.copysign(1, got) == math.copysign(1, x))


def test_rounding_specials() -> None:
    assert round_to_format(470.0, "float8_e4m3fn") == 448.0  # saturates, never NaN
    assert round_to_format(-1e30, "float8_e5m2") == -57344.0
    assert math.isnan(round_to_format(math.inf, "float8_e4m3fn"))
    assert math.isnan(round_to_format(math.nan, "float8_e5m2"))
    assert math.copysign(1, round_to_format(-0.0, "float8_e4m3fn")) == -1
    assert round_to_format(2.0**-9, "float8_e4m3fn") == 2.0**-9  # the smallest subnormal
    assert round_to_format(2.0**-10, "float8_e4m3fn") == 0.0  # a tie to even: zero


def test_scales() -> None:
    assert tensor_scale(448.0, "float8_e4m3fn") == 1.0
    assert tensor_scale(3.0, "float8_e4m3fn") == _f32(448 / 3)
    assert tensor_scale(3.0, "float8_e5m2", margin=2) == _f32(57344 / 3) / 4
    assert tensor_scale(0.0, "float8_e4m3fn") == tensor_scale(math.nan, "float8_e4m3fn") == 1.0
    assert tensor_scale(1e-45, "float8_e4m3fn") == 3.4028234663852886e38  # never inf
    assert mx_exponent(448.0) == 0 and mx_exponent(512.0) == 1 and mx_exponent(1.0) == -8
    assert mx_exponent(57344.0, "float8_e5m2") == 0
    assert mx_exponent(0.0) == -127 and mx_exponent(1e-45) == -127 and mx_exponent(math.inf) == 0
    assert mx_exponent(3e38) == 127 - 8 + 1 - 1  # floor(log2(3e38)) = 127, minus 8


# ------------------------------------------------------------------------------- delayed


@settings(max_examples=100, deadline=None)
@given(
    history=st.integers(1, 6),
    steps=st.lists(
        st.tuples(
            st.booleans(),
            st.floats(0, 1e6) | st.just(math.inf) | st.just(math.nan),
        ),
        max_size=30,
    ),
)
def test_delayed_scaling_against_a_reference(history: int, steps: list[tuple[bool, float]]) -> None:
    state = DelayedScaling(history=history, margin=1)
    kept: list[float] = []
    for skipped, amax in steps:
        state, refused = state.update({"l:input": amax}, skipped)
        if not skipped:
            if math.isfinite(amax):
                kept = [amax, *kept][:history]
                assert refused == ()
            else:
                assert refused == ("l:input",)
        assert list(state.amax_history.get("l:input", ())) == kept
        want = None if not kept else tensor_scale(max(kept), "float8_e4m3fn", 1)
        assert state.scale("l:input", "float8_e4m3fn") == want
        assert DelayedScaling.from_state_dict(json.loads(json.dumps(state.state_dict()))) == state


@pytest.mark.parametrize(
    "broken",
    [
        None,
        {"kind": "dynamic"},
        {"kind": "delayed", "history": 2, "margin": 0},
        {"kind": "delayed", "history": 2, "margin": 0, "amax_history": {"a": [1, 2, 3]}},
        {"kind": "delayed", "history": 2, "margin": 0, "amax_history": {"a": [float("nan")]}},
        {"kind": "delayed", "history": 2, "margin": 0, "amax_history": {"a": ["1"]}},
        {"kind": "delayed", "history": 0, "margin": 0, "amax_history": {}},
    ],
)
def test_a_malformed_saved_state_is_refused(broken: object) -> None:
    with pytest.raises(CheckpointError):
        DelayedScaling.from_state_dict(broken)


def test_recipes_text_forms() -> None:
    assert [str(fp8_recipe(r)) for r in FP8_RECIPES] == list(FP8_RECIPES)
    assert fp8_recipe(" Delayed ( history = 8 ) ") == FP8Recipe("delayed", 8)
    assert str(FP8Recipe("delayed", 16, 3)) == "delayed(margin=3)"
    assert fp8_recipe("none") is None and fp8_recipe(None) is None


# ------------------------------------------------------------------------------- statistics


def test_statistics_rank_fragile_layers_and_propose_rules() -> None:
    stats = FP8Statistics(("tensorwise", "rowwise"))
    for recipe, rel, flushed in (("tensorwise", 0.5, 90), ("rowwise", 0.001, 0)):
        stats.record("enc.fc", "weight", recipe, rel_mse_sum=rel * 10, rows=10, nonzero=100,
                     flushed=flushed, saturated=0, elements=100)  # fmt: skip
        stats.record("head", "input", recipe, rel_mse_sum=0.0005, rows=10, nonzero=100,
                     flushed=0, saturated=0, elements=100)  # fmt: skip
    assert stats.layers == ["enc.fc", "head"]
    assert stats.fragile("tensorwise") == ["enc.fc"] and stats.fragile("rowwise") == []
    assert stats.best_recipe("enc.fc") == "rowwise"
    assert stats.rules("tensorwise") == ["path:enc.fc=bfloat16"]
    assert stats.fragile("rowwise", Thresholds(rel_mse=1e-4)) == ["enc.fc"]
    rows = stats.to_dict()["rows"]
    assert rows[0]["underflow"] == 0.9 and rows[0]["rel_mse"] == 0.5
    assert "90.00%" in stats.table() and " !" in stats.table()
