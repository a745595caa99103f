"""Core diagnostics: dtype-report rows and text, overflow records, underflow thresholds."""

from __future__ import annotations

import mixprec
from mixprec.engine.diagnostics import ModuleDtypes, OverflowRecord, dtype_rows, format_dtype_report


def test_o2_rows_pin_batchnorm_by_class_rule_and_inherit_inside_it() -> None:
    policy = mixprec.get_policy("O2-bf16").with_module("head", "float32", match="path")
    rows = dtype_rows(
        policy,
        [
            ("", ("Sequential",), "-"),
            ("0", ("Linear",), "bfloat16"),
            ("1", ("BatchNorm1d", "_BatchNorm"), "float32"),
            ("head", ("Sequential",), "-"),
            ("head.0", ("Linear",), "float32"),
        ],
    )
    why = {r.path: (r.param_dtype, r.compute, r.rule) for r in rows}
    assert why["0"] == ("bfloat16", "bfloat16", "policy param=bfloat16")
    assert why["1"] == ("float32", "float32", "pinned by class rule *BatchNorm*")
    assert why["head"][2] == "pinned by path rule head"
    assert why["head.0"] == ("float32", "float32", "inherited from 'head'")
    text = format_dtype_report(rows)
    assert "pinned by class rule *BatchNorm*" in text
    assert text.splitlines()[0].split() == ["module", "class", "params", "compute", "why"]
    assert "(root)" in text


def test_public_names_and_empty_report() -> None:
    assert mixprec.ModuleDtypes is ModuleDtypes
    assert mixprec.format_dtype_report([]) == "no modules to report"


def test_overflow_record_prints_its_step_and_names() -> None:
    record = mixprec.OverflowRecord(3, ("fc.weight", "fc.bias"))
    assert str(record) == "step 3: non-finite gradients in fc.weight, fc.bias"
    assert "none on this rank" in str(OverflowRecord(4, ()))


def test_underflow_threshold_is_the_smallest_normal() -> None:
    assert mixprec.underflow_threshold("float16") == 2.0**-14
    assert mixprec.underflow_threshold("bf16") == 2.0**-126
    text = mixprec.format_underflow({"w": 1.0, "b": 0.25}, "float16")
    assert "100.0%" in text and "25.0%" in text and "below 6.1e-05" in text
    assert mixprec.format_underflow({}) == "no gradients to report"
