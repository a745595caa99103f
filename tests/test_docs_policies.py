"""docs/policies.md cannot drift from the code: its tables are the code's values, its TOML
example is the file the tests load, and every ```` ```python ```` block runs.

Generated parts sit between ``<!-- generated: NAME -->`` and ``<!-- /generated -->``;
``<!-- include: PATH -->`` precedes a fenced block equal to that file, and
``<!-- output: ARGS -->`` precedes a ```` ```text ```` block equal to what ``mixprec ARGS``
prints. ``python tests/test_docs_policies.py --update`` rewrites all three from the code.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import math
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import mixprec
from mixprec import cli, dtypes
from mixprec.engine import spec
from mixprec.numerics.loss_scale import DynamicScale
from mixprec.policy import forms, ops, presets
from mixprec.policy.grammar import format_loss_scale
from mixprec.policy.rules import LIST_NAMES

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "policies.md"
TOML_EXAMPLE = ROOT / "examples" / "policies" / "transformer.toml"
GENERATED = re.compile(
    r"(?P<head><!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(?P<tail><!-- /generated -->)",
    re.DOTALL,
)
INCLUDE = re.compile(
    r"(?P<head><!-- include: (?P<target>\S+) -->\n```(?P<lang>\w*)\n)(?P<body>.*?)(?P<tail>```)",
    re.DOTALL,
)
OUTPUT = re.compile(
    r"(?P<head><!-- output: (?P<args>.+?) -->\n```text\n)(?P<body>.*?)(?P<tail>```)", re.DOTALL
)
PYTHON = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)

# the groups of compute dtypes whose default op lists the doc says are identical
LOWP_RANGE_GROUP = ("float16", "float8_e4m3fn", "float8_e5m2", "auto")
FP32_RANGE_GROUP = ("bfloat16", "float32")


def _doc() -> str:
    return DOC.read_text(encoding="utf-8")


# ---------------------------------------------------------------------- generated tables


def _num(x: float) -> str:
    """Powers of two below 1 as ``2^e (decimal)``, anything else in 6 significant digits."""
    mantissa, exponent = math.frexp(x)
    if mantissa == 0.5 and x < 1:
        return f"2^{exponent - 1} ({x:.3g})"
    return f"{x:.6g}"


def _formats() -> str:
    # one bits column (exponent + mantissa): the table fits the page without a scroll
    rows = [
        "| dtype | aliases | bits (exponent + mantissa) | max | smallest normal "
        "| smallest subnormal | eps |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in (*dtypes.POLICY_DTYPES, dtypes.FLOAT64):
        info = mixprec.format_info(name)
        aliases = sorted(a for a, target in dtypes._ALIASES.items() if target == name)
        rows.append(
            f"| `{name}` | {', '.join(f'`{a}`' for a in aliases) or '—'} "
            f"| {info.bits} ({info.exponent_bits} + {info.mantissa_bits}) | {_num(info.max)} "
            f"| {_num(info.smallest_normal)} | {_num(info.smallest_subnormal)} | {_num(info.eps)} |"
        )
    return "\n".join(rows) + "\n"


def _op_lists_cell(policy: mixprec.Policy) -> str:
    for lowp in ("float16", "bfloat16"):
        if policy.ops == presets.default_op_rules(lowp):
            return f"casting ({lowp} lists)"
        if policy.ops == presets.passthrough_op_rules(lowp):
            banned = ", ".join(f"`{op}`" for op in sorted(policy.ops.banned))
            return "all pass through" + (f", {banned} banned" if banned else "")
    raise AssertionError(f"preset {policy.name}: op lists are neither defaults nor passthrough")


def _presets() -> str:
    """Two tables, the dtype roles, then loss scale and rules: one would not fit the page."""
    roles = [
        "| preset | aliases | param | compute | output | master | reduce |",
        "|---|---|---|---|---|---|---|",
    ]
    rules = ["| preset | loss scale | op lists | module rules | fp8 |", "|---|---|---|---|---|"]
    for name in presets.BUILTIN_PRESETS:
        p = mixprec.get_policy(name)
        aliases = ", ".join(f"`{a}`" for a, target in presets.ALIASES.items() if target == name)
        module_rules = ", ".join(f"`{rule}`" for rule in p.modules) or "—"
        scale = format_loss_scale(p.loss_scale)
        roles.append(
            f"| `{name}` | {aliases or '—'} | {p.param} | {p.compute} | {p.output} "
            f"| {p.master or '—'} | {p.reduce} |"
        )
        fp8 = f"`{p.fp8}`" if p.fp8 is not None else "—"
        rules.append(f"| `{name}` | `{scale}` | {_op_lists_cell(p)} | {module_rules} | {fp8} |")
    return "\n".join(roles) + "\n\n" + "\n".join(rules) + "\n"


def _op_defaults() -> str:
    first, second = (
        presets.default_op_rules(group[0]) for group in (LOWP_RANGE_GROUP, FP32_RANGE_GROUP)
    )
    head = (
        " / ".join(f"`{d}`" for d in LOWP_RANGE_GROUP),
        " / ".join(f"`{d}`" for d in FP32_RANGE_GROUP),
    )
    rows = [f"| list | compute {head[0]} | compute {head[1]} |", "|---|---|---|"]
    order = {op: i for i, op in enumerate(ops.OP_FAMILIES)}
    for name in LIST_NAMES:
        cells = [
            ", ".join(f"`{op}`" for op in sorted(getattr(rules, name), key=order.__getitem__))
            or "—"
            for rules in (first, second)
        ]
        rows.append(f"| `{name}` | {cells[0]} | {cells[1]} |")
    return "\n".join(rows) + "\n"


GENERATORS: dict[str, Callable[[], str]] = {
    "formats": _formats,
    "presets": _presets,
    "op-defaults": _op_defaults,
}


def _cli_output(args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(shlex.split(args)) == 0
    return out.getvalue()


def _included(target: str) -> str:
    return (ROOT / target).read_text(encoding="utf-8")


def test_generated_tables_match_the_code() -> None:
    found = {m["name"]: m["body"] for m in GENERATED.finditer(_doc())}
    assert set(found) == set(GENERATORS), f"generated blocks in the doc: {sorted(found)}"
    stale = [name for name, make in GENERATORS.items() if found[name] != make()]
    assert not stale, f"stale tables in docs/policies.md (run python {__file__} --update): {stale}"


def test_included_files_and_cli_outputs_match() -> None:
    text = _doc()
    includes = list(INCLUDE.finditer(text))
    assert any(m["target"] == "examples/policies/transformer.toml" for m in includes)
    for m in includes:
        assert m["body"] == _included(m["target"]), f"stale include of {m['target']}"
    outputs = list(OUTPUT.finditer(text))
    assert outputs, "the doc shows no CLI output"
    for m in outputs:
        assert m["body"] == _cli_output(m["args"]), f"stale output of `mixprec {m['args']}`"


# ---------------------------------------------------------------------- facts behind the prose


def test_format_table_numbers_are_the_format_facts() -> None:
    # independent of _num: every number printed in a row reads back close to format_info
    rows = _table_after("## Dtypes")
    assert len(rows) == len(dtypes.POLICY_DTYPES) + 1
    for cells in rows:
        info = mixprec.format_info(cells[0].strip("`"))
        facts = (info.max, info.smallest_normal, info.smallest_subnormal, info.eps)
        for cell, real in zip(cells[3:], facts, strict=True):
            shown = float(cell.split("(")[-1].rstrip(")"))
            assert math.isclose(shown, real, rel_tol=5e-3), (cells[0], cell, real)
        bits = (info.bits, info.exponent_bits, info.mantissa_bits)
        assert cells[2] == "{} ({} + {})".format(*bits), (cells[0], cells[2])
        for alias in re.findall(r"`([\w.]+)`", cells[1]):
            assert mixprec.canonical_dtype(alias) == info.name


def test_op_default_groups_are_identical() -> None:
    for group in (LOWP_RANGE_GROUP, FP32_RANGE_GROUP):
        first = presets.default_op_rules(group[0])
        assert all(presets.default_op_rules(d) == first for d in group), group
    assert presets.default_op_rules("float16") != presets.default_op_rules("bfloat16")
    every = set(ops.OP_FAMILIES)
    for dtype in (*LOWP_RANGE_GROUP, *FP32_RANGE_GROUP):
        assert presets.default_op_rules(dtype).listed == every  # every family is named somewhere


def test_aliases_equal_their_presets_and_casting_presets_use_defaults() -> None:
    for alias, target in presets.ALIASES.items():
        assert mixprec.get_policy(alias) == mixprec.get_policy(target)
    for name in ("O1", "O1-bf16"):
        p = mixprec.get_policy(name)
        assert p.ops == presets.default_op_rules(p.compute)
    assert mixprec.get_policy("auto").ops == presets.default_op_rules("float16")


def _table_after(heading: str) -> list[list[str]]:
    """The body rows (cells stripped) of the first table after ``heading``."""
    text = _doc()
    assert heading in text, f"docs/policies.md has no {heading!r}"
    table = re.search(r"\n((?:\|.*\n)+)", text[text.index(heading) :])
    assert table, f"no table after {heading!r}"
    rows = table.group(1).splitlines()[2:]  # skip the header and the |---| line
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows]


def _first_column_keys(heading: str) -> set[str]:
    return {key for row in _table_after(heading) for key in re.findall(r"`([^`]+)`", row[0])}


def test_documented_keys_are_the_real_keys() -> None:
    assert _first_column_keys("## Dtype roles") == set(presets.ROLE_FIELDS)
    assert _first_column_keys("### Keys") == set(spec._KEYS)
    assert _first_column_keys("### Mapping keys") == set(forms.MAPPING_KEYS)
    assert _first_column_keys("### Op lists") == set(LIST_NAMES)


def test_dynamic_scale_defaults_are_documented() -> None:
    documented = {
        row[0].strip("`"): ast.literal_eval(row[1].split("`")[1])
        for row in _table_after("### DynamicScale fields")
    }
    real = {f.name: f.default for f in dataclasses.fields(DynamicScale)}
    assert documented == real


# ---------------------------------------------------------------------- runnable examples


def test_toml_example_loads_and_round_trips() -> None:
    policy = mixprec.load_toml(TOML_EXAMPLE)
    assert policy == mixprec.load_toml(TOML_EXAMPLE.read_text(encoding="utf-8"))
    assert mixprec.load_toml(policy.to_toml()) == policy
    assert mixprec.get_policy(str(policy)) == policy
    assert policy != mixprec.get_policy("O2")  # the file really changes its base


def error_of(call: Callable[[], object]) -> str:
    """The message of the MixprecError that ``call()`` raises (the page's examples use it)."""
    try:
        call()
    except mixprec.MixprecError as err:
        return str(err)
    raise AssertionError("no error was raised")


def test_python_examples_run(monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = PYTHON.findall(_doc())
    assert len(blocks) >= 8, "the doc should show its API with runnable examples"
    assert sum(block.count("assert ") for block in blocks) >= 30, "examples must check results"
    monkeypatch.chdir(ROOT)  # examples name files relative to the repository root
    namespace: dict[str, object] = {"__name__": "docs_policies", "error_of": error_of}
    for number, block in enumerate(blocks, 1):
        try:
            exec(compile(block, f"docs/policies.md python block {number}", "exec"), namespace)
        except Exception as err:  # pragma: no cover - the message is the point
            pytest.fail(f"python block {number} of docs/policies.md failed: {err!r}\n{block}")


def update() -> None:
    """Rewrite the generated tables, included files and CLI outputs of docs/policies.md."""
    text = _doc()
    text = GENERATED.sub(lambda m: m["head"] + GENERATORS[m["name"]]() + m["tail"], text)
    text = INCLUDE.sub(lambda m: m["head"] + _included(m["target"]) + m["tail"], text)
    text = OUTPUT.sub(lambda m: m["head"] + _cli_output(m["args"]) + m["tail"], text)
    DOC.write_text(text, encoding="utf-8")


if __name__ == "__main__" and "--update" in sys.argv:
    update()
