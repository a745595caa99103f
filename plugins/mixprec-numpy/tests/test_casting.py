"""bfloat16 and float16 casts round to nearest even, bit for bit like the core's reference."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from mixprec.errors import UnsupportedDtypeError
from mixprec.testing.floats import round_to
from mixprec_numpy import cast, round_to_bfloat16

SPECIAL = [
    0.0,
    -0.0,
    1.0,
    1.0 + 2**-8,
    1.0 + 3 * 2**-8,
    -(1.0 + 2**-8),
    3.4e38,
    -3.4e38,
    1e-40,
    65504.0,
    65520.0,
    70000.0,
    np.inf,
    -np.inf,
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cast_matches_reference_rounding(dtype: str) -> None:
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [
            np.array(SPECIAL, np.float32),
            rng.standard_normal(2000).astype(np.float32) * np.float32(1e3),
            rng.standard_normal(500).astype(np.float32) * np.float32(1e-6),
        ]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # overflow to inf is silent, as in every framework
        got = cast(values, dtype).astype(np.float32)
    want = np.array([round_to(dtype, float(v)) for v in values], np.float32)
    np.testing.assert_array_equal(got, want)


def test_bfloat16_keeps_nan_and_shape() -> None:
    x = np.array([[np.nan, 1.5], [2.0, -np.nan]], np.float32)
    out = round_to_bfloat16(x)
    assert out.shape == x.shape and out.dtype == np.float32
    assert np.isnan(out).tolist() == [[True, False], [False, True]]
    assert round_to_bfloat16(np.float32(1.0 + 2**-7)).shape == ()


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(UnsupportedDtypeError, match="float8_e4m3fn"):
        cast(np.ones(2), "float8_e4m3fn")
