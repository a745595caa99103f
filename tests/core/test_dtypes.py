"""Dtype names, aliases, format facts and promotion."""

from __future__ import annotations

import struct

import pytest

from mixprec.dtypes import (
    POLICY_DTYPES,
    canonical_dtype,
    format_info,
    is_floating,
    is_low_precision,
    widest,
)
from mixprec.errors import PolicyError


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ("fp16", "float16"),
        ("half", "float16"),
        ("f16", "float16"),
        ("FP16", "float16"),
        ("torch.float16", "float16"),
        ("torch.half", "float16"),
        ("np.float16", "float16"),
        ("<class 'numpy.float16'>", "float16"),
        ("float16", "float16"),
        ("bf16", "bfloat16"),
        ("torch.bfloat16", "bfloat16"),
        ("BFloat16", "bfloat16"),
        ("fp32", "float32"),
        ("float", "float32"),
        ("f32", "float32"),
        ("torch.float32", "float32"),
        ("mx.float32", "float32"),
        ("float8_e4m3fn", "float8_e4m3fn"),
        ("fp8_e5m2", "float8_e5m2"),
        (" float32 ", "float32"),
    ],
)
def test_aliases_normalise(alias: str, canonical: str) -> None:
    assert canonical_dtype(alias) == canonical


def test_str_of_dtype_objects_is_accepted() -> None:
    class FakeDtype:
        def __str__(self) -> str:
            return "torch.bfloat16"

    assert canonical_dtype(FakeDtype()) == "bfloat16"


def test_unknown_dtype_lists_valid_names_and_close_match() -> None:
    with pytest.raises(PolicyError) as err:
        canonical_dtype("bfloat61")
    message = str(err.value)
    assert "'bfloat16'" in message  # the close match
    for name in POLICY_DTYPES:
        assert name in message
    assert "bf16" in message  # aliases are listed too


def _f32(x: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


def test_float16_facts() -> None:
    info = format_info("fp16")
    assert (info.bits, info.exponent_bits, info.mantissa_bits) == (16, 5, 10)
    assert info.max == 65504.0
    assert info.smallest_normal == 2.0**-14 == 6.103515625e-05
    assert info.smallest_subnormal == 2.0**-24
    assert info.eps == 2.0**-10 == 0.0009765625
    # cross-check against the IEEE half codec in struct: max and subnormal are exact
    assert struct.unpack("<e", struct.pack("<e", info.max))[0] == info.max
    assert struct.unpack("<e", struct.pack("<e", info.smallest_subnormal))[0] > 0
    assert struct.unpack("<e", struct.pack("<e", info.smallest_subnormal / 2))[0] == 0


def test_bfloat16_facts() -> None:
    info = format_info("bf16")
    assert (info.bits, info.exponent_bits, info.mantissa_bits) == (16, 8, 7)
    assert info.max == pytest.approx(3.3895313892515355e38, rel=0, abs=0)
    assert info.eps == 2.0**-7
    assert info.smallest_normal == 2.0**-126 == format_info("float32").smallest_normal
    assert info.smallest_subnormal == 2.0**-133


def test_float32_facts_match_struct() -> None:
    info = format_info("float32")
    assert info.max == _f32(3.4028234663852886e38) == 3.4028234663852886e38
    assert info.eps == 2.0**-23 == 1.1920928955078125e-07
    assert info.smallest_subnormal == 2.0**-149
    assert _f32(info.smallest_subnormal) == info.smallest_subnormal


def test_float8_facts() -> None:
    e4m3 = format_info("float8_e4m3fn")
    assert (e4m3.bits, e4m3.exponent_bits, e4m3.mantissa_bits) == (8, 4, 3)
    assert e4m3.max == 448.0
    assert e4m3.smallest_normal == 2.0**-6
    assert e4m3.smallest_subnormal == 2.0**-9
    assert e4m3.eps == 0.125
    e5m2 = format_info("float8_e5m2")
    assert (e5m2.bits, e5m2.exponent_bits, e5m2.mantissa_bits) == (8, 5, 2)
    assert e5m2.max == 57344.0
    assert e5m2.smallest_normal == 2.0**-14
    assert e5m2.smallest_subnormal == 2.0**-16
    assert e5m2.eps == 0.25


def test_low_precision() -> None:
    assert is_low_precision("float16") and is_low_precision("bf16")
    assert is_low_precision("float8_e4m3fn") and is_low_precision("float8_e5m2")
    assert not is_low_precision("float32") and not is_low_precision("float64")


def test_is_floating_never_raises() -> None:
    assert is_floating("half") and not is_floating("int64") and not is_floating("bool")


@pytest.mark.parametrize(
    ("dtypes", "expected"),
    [
        (["float16"], "float16"),
        (["float16", "float16"], "float16"),
        (["float16", "float32"], "float32"),
        (["float16", "bfloat16"], "float32"),
        (["bfloat16", "float32"], "float32"),
        (["float8_e4m3fn", "float16"], "float16"),
        (["float8_e4m3fn", "float8_e5m2"], "float16"),
        (["float8_e5m2", "bfloat16"], "bfloat16"),
        (["fp16", "float64"], "float64"),
    ],
)
def test_widest(dtypes: list[str], expected: str) -> None:
    assert widest(dtypes) == expected


def test_widest_of_nothing_is_an_error() -> None:
    with pytest.raises(PolicyError, match="at least one"):
        widest([])


def test_holds() -> None:
    from mixprec.dtypes import holds

    assert holds("float32", "bfloat16") and holds("float32", "float16")
    assert not holds("float16", "bfloat16") and not holds("bfloat16", "float16")
    assert holds("float16", "float8_e4m3fn") and not holds("float8_e5m2", "float8_e4m3fn")
