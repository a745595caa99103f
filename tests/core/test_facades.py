"""``mixprec.<backend>``: one generic facade for every registered backend."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

import mixprec
from mixprec.backend import BackendInfo
from mixprec.engine import plugins
from mixprec.engine.facades import BackendFacade
from mixprec.engine.hookspecs import hookimpl
from mixprec.errors import BackendNotAvailable


@pytest.fixture
def forget_facade() -> Iterator[list[str]]:
    """Names of facades a test creates for in-process plugins, removed afterwards."""
    names: list[str] = []
    yield names
    for name in names:
        sys.modules.pop(f"mixprec.{name}", None)
        mixprec.__dict__.pop(name, None)
    plugins.reset()


class MissingFramework:
    @hookimpl
    def mixprec_register_backends(self) -> list[BackendInfo]:
        return [BackendInfo("ghostly", "no_such_framework_xyz", "json", extra="ghostly")]


def test_numpy_plugin_has_a_facade_like_the_builtins() -> None:
    mixprec_numpy = pytest.importorskip("mixprec_numpy")
    import mixprec.numpy as mp

    assert isinstance(mp, BackendFacade)
    assert mp.Trainer is mixprec_numpy.Trainer
    assert mixprec.numpy is mp


def test_documented_torch_idioms_reach_the_backend() -> None:
    mixprec_torch = pytest.importorskip("mixprec_torch")
    import mixprec.torch as mp
    from mixprec import torch as same

    assert same is mp is sys.modules["mixprec.torch"]
    assert mp.wrap is mixprec_torch.wrap
    assert "wrap" in dir(mp)


def test_mxnet_facade_is_the_same_mechanism() -> None:
    from mixprec import mxnet

    assert type(mxnet) is BackendFacade and mxnet.BACKEND == "mxnet"


def test_unknown_backend_is_neither_an_attribute_nor_a_module() -> None:
    with pytest.raises(AttributeError, match="no attribute 'no_such_backend'"):
        mixprec.no_such_backend  # noqa: B018
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("mixprec.no_such_backend")


def test_facade_of_a_backend_without_its_framework_names_the_extra(
    forget_facade: list[str],
) -> None:
    plugins.register(MissingFramework(), name="ghostly-plugin")
    forget_facade.append("ghostly")
    facade = importlib.import_module("mixprec.ghostly")  # importing it needs no framework
    with pytest.raises(BackendNotAvailable, match=r"pip install 'mixprec\[ghostly\]'"):
        facade.anything  # noqa: B018


def test_every_facade_comes_from_the_one_mechanism() -> None:
    # no per-backend files: torch, mxnet and numpy are all built by mixprec.engine.facades
    for name in ("torch", "mxnet", "numpy"):
        spec = importlib.util.find_spec(f"mixprec.{name}")
        assert spec is not None and spec.origin == f"backend {name!r}", spec


def test_facade_import_in_a_fresh_process_needs_no_prior_attribute_access() -> None:
    code = "import mixprec.numpy as mp, sys\nassert mp.BACKEND == 'numpy'\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_facade_of_a_known_plugin_that_is_missing_names_the_extra() -> None:
    """``mixprec.jax`` without the mixprec-jax plugin: importing works, using it says what
    to install (run with the plugin blocked, so it holds wherever the plugin is installed)."""
    script = (
        "import mixprec.jax as mpj\n"
        "try:\n"
        "    mpj.Optimizer\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    env = {**os.environ, "MIXPREC_DISABLE_PLUGINS": ""}
    if importlib.util.find_spec("mixprec_jax") is not None:
        pytest.skip("the mixprec-jax plugin is installed here")
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True
    ).stdout
    assert out.startswith("BackendNotAvailable"), out
    assert "mixprec-jax plugin, which is not installed" in out
    assert "pip install 'mixprec[jax]'" in out


#: What a package imports for itself, never part of its public face.
PLUMBING = {"lazy_exports", "plugin", "TYPE_CHECKING", "annotations"}


@pytest.mark.parametrize("backend", ["torch", "mxnet", "numpy"])
def test_star_import_and_dir_see_the_backends_public_names(backend: str) -> None:
    """``from mixprec.<backend> import *`` and tab completion (``dir``), in a fresh process
    as a user meets them: the backend's ``__all__``, none of its plumbing."""
    api = f"mixprec_{backend}"
    if importlib.util.find_spec(api) is None or importlib.util.find_spec(backend) is None:
        pytest.skip(f"the {backend} backend is not installed here")
    script = (
        "import json, mixprec, importlib\n"
        f"facade = importlib.import_module('mixprec.{backend}')\n"
        "names = {}\n"
        f"exec('from mixprec.{backend} import *', names)\n"
        f"api = importlib.import_module('{api}')\n"
        "star = sorted(n for n in names if not n.startswith('__'))\n"
        "shown = [n for n in dir(facade) if not n.startswith('_')]\n"
        "print(json.dumps({'all': facade.__all__, 'star': star, 'dir': shown,\n"
        "    'api_all': sorted(api.__all__), 'api_dir': dir(api)}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300
    ).stdout
    seen = json.loads(out.splitlines()[-1])
    assert seen["all"] == seen["api_all"] == seen["star"]
    assert set(seen["dir"]) == {*seen["api_all"], "BACKEND"}
    assert not PLUMBING & (set(seen["star"]) | set(seen["dir"]))
    # the package itself lists its real submodules (plugin), not the names it imports
    assert not (PLUMBING - {"plugin"}) & set(seen["api_dir"])
