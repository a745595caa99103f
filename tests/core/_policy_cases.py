"""Names and checks shared by the preset and spec tests."""

from __future__ import annotations

import json

from mixprec.engine.spec import get_policy, load_toml
from mixprec.policy.value import ModuleRule, Policy

ALL_NAMES = [
    "O0",
    "O1",
    "O2",
    "O3",
    "O1-bf16",
    "O2-bf16",
    "O3-bf16",
    "O3-bf16-kahan",
    "O3-bf16-sr",
    "O1-fp8",
    "O2-fp8",
    "auto",
]
ALIASES = {
    "32": "O0",
    "16-mixed": "O1",
    "bf16-mixed": "O1-bf16",
    "16-true": "O3",
    "bf16-true": "O3-bf16",
}
BN = ModuleRule("class", "*BatchNorm*", "float32")


def round_trips(policy: Policy) -> None:
    """``policy`` survives str, dict, JSON and TOML unchanged."""
    assert get_policy(str(policy)) == policy, str(policy)
    assert Policy.from_dict(policy.to_dict()) == policy
    assert get_policy(json.loads(json.dumps(policy.to_dict()))) == policy
    assert load_toml(policy.to_toml()) == policy, policy.to_toml()
