"""The plugin manager: registration, blocking, duplicates and lazy backend loading."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

import mixprec
from mixprec.backend import BackendInfo, Capabilities, DeviceCapability
from mixprec.engine import plugins
from mixprec.engine.hookspecs import hookimpl
from mixprec.engine.plugins import load_backend
from mixprec.errors import BackendNotAvailable, PluginError


@pytest.fixture(autouse=True)
def fresh_plugins() -> Iterator[None]:
    plugins.reset()
    yield
    plugins.reset()


class FakeBackendPlugin:
    def __init__(self, name: str, framework: str = "json") -> None:
        self.info = BackendInfo(name=name, framework=framework, api_module="json", extra=name)

    @hookimpl
    def mixprec_register_backends(self) -> list[BackendInfo]:
        return [self.info]


def test_builtin_backends_are_declared_without_importing_frameworks() -> None:
    names = {row.info.name for row in plugins.list_backends()}
    assert {"torch", "mxnet"} <= names


def test_in_process_backend_loads_its_api_module() -> None:
    plugins.register(FakeBackendPlugin("fake"), name="fake-plugin")
    assert load_backend("fake").__name__ == "json"


def test_two_plugins_claiming_one_backend_is_an_error() -> None:
    plugins.register(FakeBackendPlugin("twin"), name="first")
    plugins.register(FakeBackendPlugin("twin"), name="second")
    rows = [row for row in plugins.list_backends() if row.info.name == "twin"]
    assert len(rows) == 2 and all("claimed by plugins" in (row.error or "") for row in rows)
    with pytest.raises(PluginError, match="claimed by several plugins"):
        load_backend("twin")


def test_missing_framework_names_the_extra() -> None:
    plugins.register(FakeBackendPlugin("ghost", framework="no_such_framework_xyz"), name="ghost")
    with pytest.raises(BackendNotAvailable, match=r"pip install 'mixprec\[ghost\]'"):
        load_backend("ghost")


def test_unknown_backend_lists_the_installed_ones() -> None:
    with pytest.raises(BackendNotAvailable, match=r"installed backends: .*torch"):
        load_backend("jaxx")


def test_plugin_with_wrong_hook_signature_is_reported_by_name() -> None:
    class WrongSignature:
        @hookimpl
        def mixprec_step_skipped(self, step: int, scale_value: float) -> None: ...

    with pytest.raises(PluginError, match="wrong-sig"):
        plugins.register(WrongSignature(), name="wrong-sig")
    assert "wrong-sig" in plugins.broken_plugins()
    assert {"torch", "mxnet"} <= {row.info.name for row in plugins.list_backends()}


def test_plugin_with_unknown_hook_is_reported() -> None:
    class UnknownHook:
        @hookimpl
        def mixprec_no_such_hook(self) -> None: ...

    with pytest.raises(PluginError, match="unknown-hook"):
        plugins.register(UnknownHook(), name="unknown-hook")


def test_observer_hooks_receive_calls() -> None:
    seen: list[tuple[int, float]] = []

    class Observer:
        @hookimpl
        def mixprec_step_skipped(self, step: int, loss_scale: float) -> None:
            seen.append((step, loss_scale))

    plugins.register(Observer(), name="observer")
    plugins.emit_step_skipped(3, 1024.0)
    assert seen == [(3, 1024.0)]


def test_disable_env_blocks_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugins.DISABLE_ENV, "mxnet")
    names = {row.info.name for row in plugins.list_backends()}
    assert "mxnet" not in names and "torch" in names
    with pytest.raises(BackendNotAvailable, match="'mxnet' backend is disabled") as err:
        load_backend("mxnet")
    assert plugins.DISABLE_ENV in str(err.value) and "not installed" not in str(err.value)


def test_capabilities_prefer_bfloat16() -> None:
    caps = Capabilities(
        "x",
        "1",
        (
            DeviceCapability("cpu", ("float32", "bfloat16"), ("bfloat16",)),
            DeviceCapability("cuda:0", ("float32", "float16", "bfloat16"), ("float16",)),
        ),
    )
    assert caps.preferred_lowp("cpu") == "bfloat16"
    assert caps.preferred_lowp("cuda") == "float16"
    with pytest.raises(BackendNotAvailable, match="devices here: cpu, cuda:0"):
        caps.device("tpu")


def test_lazy_names_resolve() -> None:
    assert mixprec.hookimpl is hookimpl
    with pytest.raises(AttributeError):
        mixprec.no_such_name  # noqa: B018


def test_import_mixprec_does_not_import_frameworks() -> None:
    code = (
        "import sys, mixprec\n"
        "p = mixprec.get_policy('O2-bf16')\n"
        "assert str(p)\n"
        "rows = mixprec.list_backends()\n"
        "assert {'torch', 'mxnet'} <= {r.info.name for r in rows}, rows\n"
        "import mixprec.torch as mt\n"  # the facades themselves import no framework
        "from mixprec import mxnet\n"
        "assert (mt.BACKEND, mxnet.BACKEND, mixprec.numpy.BACKEND) == ('torch', 'mxnet', 'numpy')\n"
        "heavy = [m for m in ('torch', 'mxnet', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize(("wrong", "right"), [("pytorch", "torch"), ("gluon", "mxnet")])
def test_a_common_wrong_backend_name_suggests_the_real_one(wrong: str, right: str) -> None:
    with pytest.raises(BackendNotAvailable, match=f"Did you mean '{right}'") as err:
        load_backend(wrong)
    message = str(err.value)
    assert f"mixprec[{right}]" in message and f"mixprec[{wrong}]" not in message


def test_a_misspelt_backend_name_gets_the_close_match() -> None:
    with pytest.raises(BackendNotAvailable, match="Did you mean 'mxnet'"):
        load_backend("mxnt")


def test_disabling_every_plugin_says_so_not_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugins.DISABLE_ENV, "*")
    assert set(plugins.disabled_plugins()) >= {"torch", "mxnet"}
    with pytest.raises(BackendNotAvailable, match=r"MIXPREC_DISABLE_PLUGINS='\*'") as err:
        load_backend("torch")
    assert "disabled" in str(err.value) and "not installed" not in str(err.value)
