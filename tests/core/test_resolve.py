"""resolve_for_device: the one place a backend turns a spec into the policy it runs."""

from __future__ import annotations

import pytest

from mixprec.backend import Capabilities, DeviceCapability
from mixprec.engine import plugins
from mixprec.engine.hookspecs import hookimpl
from mixprec.engine.spec import get_policy, resolve_for_device
from mixprec.errors import BackendNotAvailable, MixprecWarning, UnsupportedDtypeError
from mixprec.policy.value import Policy

pytestmark = pytest.mark.usefixtures("fresh_plugins")

CAPS = Capabilities(
    "fake",
    "1.0",
    (
        DeviceCapability("cpu", ("float32", "bfloat16"), ("bfloat16",)),
        DeviceCapability("cuda:0", ("float32", "float16"), ("float16",)),
        DeviceCapability("slow:0", ("float32",)),
        DeviceCapability("old:0", ("float32", "float16"), (), "no tensor cores (need 7.0)"),
    ),
)


class Observer:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str]] = []

    @hookimpl
    def mixprec_policy_resolved(self, policy: Policy, backend: str, device: str) -> None:
        self.seen.append((str(policy), backend, device))


@pytest.fixture
def observer() -> Observer:
    seen = Observer()
    plugins.register(seen, name="observer")
    return seen


def test_auto_resolves_from_the_device_and_fires_the_hook_once(observer: Observer) -> None:
    assert resolve_for_device("auto", "fake", "cpu", CAPS) == get_policy("O1-bf16")
    assert resolve_for_device(None, "fake", "cuda", CAPS) == get_policy("O1")
    assert observer.seen == [("O1-bf16", "fake", "cpu"), ("O1", "fake", "cuda")]


def test_overrides_apply_before_resolution() -> None:
    policy = resolve_for_device("O2", "fake", "cuda:0", CAPS, compute="bfloat16")
    assert policy == get_policy("O2-bf16")


def test_a_device_without_fast_low_precision_runs_float32_with_a_warning() -> None:
    with pytest.warns(MixprecWarning, match="no fast float16/bfloat16"):
        assert resolve_for_device("auto", "fake", "slow:0", CAPS) == get_policy("O0")
    with pytest.warns(MixprecWarning):
        assert resolve_for_device("auto", "fake", "meta", None) == get_policy("O0")


def test_the_float32_warning_names_what_the_device_lacks() -> None:
    with pytest.warns(MixprecWarning) as warned:
        assert resolve_for_device("auto", "fake", "old:0", CAPS) == get_policy("O0")
    assert "no fast float16/bfloat16 compute (no tensor cores (need 7.0)), so training" in str(
        warned[0].message
    )
    assert CAPS.device("old").describe() == "old:0: float32, float16 — no tensor cores (need 7.0)"


def test_an_unknown_device_is_refused_naming_the_known_ones(observer: Observer) -> None:
    with pytest.raises(BackendNotAvailable, match="cpu, cuda:0, slow:0, old:0"):
        resolve_for_device("O2", "fake", "tpu", CAPS)
    assert observer.seen == []


def test_a_refusing_check_keeps_the_hook_silent(observer: Observer) -> None:
    def no_float16(policy: Policy) -> None:
        if policy.compute == "float16":
            raise UnsupportedDtypeError("float16 is not for this device")

    with pytest.raises(UnsupportedDtypeError):
        resolve_for_device("O1", "fake", "cpu", CAPS, check=no_float16)
    assert observer.seen == []
    resolve_for_device("O1-bf16", "fake", "cpu", CAPS, check=no_float16)
    assert observer.seen == [("O1-bf16", "fake", "cpu")]
