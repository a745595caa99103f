"""The compensated master-weight strategies in the policy: grammar, validation, text forms."""

from __future__ import annotations

import pytest

import mixprec
from mixprec import PolicyError, get_policy
from mixprec.cli import main
from mixprec.engine.diagnostics import dtype_rows


@pytest.mark.parametrize(
    ("name", "strategy"), [("O3-bf16-kahan", "kahan"), ("O3-bf16-sr", "stochastic")]
)
def test_presets_are_o3_bf16_with_a_strategy(name: str, strategy: str) -> None:
    policy = get_policy(name)
    assert policy.master == strategy
    assert policy.master_strategy == strategy
    assert not policy.uses_masters  # no float32 copy is kept
    assert policy == get_policy("O3-bf16", master=strategy)
    assert str(policy) == name


@pytest.mark.parametrize("strategy", ["kahan", "stochastic", "KAHAN"])
def test_strategy_round_trips_through_every_text_form(strategy: str) -> None:
    policy = get_policy(f"base=O3-bf16,master={strategy},output=float32")
    assert policy.master == strategy.lower()
    assert get_policy(str(policy)) == policy
    assert mixprec.load_toml(policy.to_toml()) == policy
    assert mixprec.Policy.from_dict(policy.to_dict()) == policy


def test_strategy_needs_bfloat16_params() -> None:
    with pytest.raises(PolicyError, match="param='bfloat16'"):
        get_policy("O2", master="kahan")
    with pytest.raises(PolicyError, match="param=float32"):
        get_policy("O0", master="stochastic")


def test_unknown_master_names_the_strategies() -> None:
    with pytest.raises(PolicyError, match="kahan, stochastic"):
        get_policy("O3-bf16", master="kahn")


def test_classic_masters_are_unchanged() -> None:
    policy = get_policy("O2-bf16")
    assert policy.uses_masters and policy.master_strategy is None
    assert "float32 master copies" in policy.describe_master()


def test_dtype_report_names_the_strategy() -> None:
    rows = dtype_rows(get_policy("O3-bf16-kahan"), [("", ("Linear",), "bfloat16")])
    assert rows[0].rule == "policy param=bfloat16, master=kahan"


def test_cli_policies_describes_the_strategy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policies", "--brief", "O3-bf16-sr"]) == 0
    out = capsys.readouterr().out
    assert "master=stochastic" in out
    assert "rounded stochastically" in out


# ---------------------------------------------------------------------- state=bfloat16


@pytest.mark.parametrize("base", ["O3-bf16-kahan", "O3-bf16-sr"])
@pytest.mark.parametrize("spelling", ["bfloat16", "bf16", "BFloat16"])
def test_state_item_round_trips_through_every_text_form(base: str, spelling: str) -> None:
    policy = get_policy(f"{base},state={spelling}")
    assert policy.state == "bfloat16"
    assert str(policy) == f"base={base},state=bfloat16"
    assert policy == get_policy(base, state="bfloat16")
    assert policy != get_policy(base) and hash(policy) != hash(get_policy(base))
    assert policy.to_dict()["state"] == "bfloat16"
    assert get_policy(str(policy)) == policy
    assert mixprec.load_toml(policy.to_toml()) == policy
    assert mixprec.Policy.from_dict(policy.to_dict()) == policy
    assert get_policy(f"{base},state=none") == get_policy(base)


def test_state_defaults_to_the_optimizers_own() -> None:
    for name in ("O0", "O2-bf16", "O3-bf16-kahan"):
        policy = get_policy(name)
        assert policy.state is None
        assert policy.describe_state() == "as the optimizer allocates it"
    assert mixprec.load_toml(get_policy("O2").to_toml()).state is None


@pytest.mark.parametrize("spec", ["O2-bf16,state=bfloat16", "O3-bf16,state=bfloat16", "O0"])
def test_bf16_state_needs_a_compensated_strategy(spec: str) -> None:
    with pytest.raises(PolicyError, match="master='kahan' or 'stochastic'"):
        get_policy(spec, state="bfloat16")
    with pytest.raises(PolicyError, match="drop state"):  # a master change keeps no state
        get_policy("O3-bf16-kahan,state=bfloat16", master="float32")


@pytest.mark.parametrize("value", ["float16", "float32", "int3", "uint8"])
def test_other_state_dtypes_are_refused(value: str) -> None:
    with pytest.raises(PolicyError, match="state='bfloat16'"):
        get_policy("O3-bf16-kahan", state=value)


def test_dtype_report_and_cli_name_the_state(capsys: pytest.CaptureFixture[str]) -> None:
    policy = get_policy("O3-bf16-sr,state=bfloat16")
    rows = dtype_rows(policy, [("", ("Linear",), "bfloat16")])
    assert rows[0].rule == "policy param=bfloat16, master=stochastic, state=bfloat16"
    assert main(["policies", "--brief", "O3-bf16-kahan,state=bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "state=bfloat16" in out
    assert "bfloat16 between steps (stochastic rounding, seeded)" in out
