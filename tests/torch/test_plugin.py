"""The torch backend's plugin: declared without importing torch, loaded through the facade."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import mixprec  # noqa: E402
import mixprec.torch as mpt  # noqa: E402
import mixprec_torch  # noqa: E402
from mixprec.kit import BackendInfo  # noqa: E402
from mixprec.testing import ConformanceAdapter  # noqa: E402

pytestmark = pytest.mark.torch


def test_plugin_module_does_not_import_torch() -> None:
    code = (
        "import sys, mixprec_torch.plugin as p\n"
        "infos = p.mixprec_register_backends()\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
        "print(infos[0].api_module)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "mixprec_torch"


def test_backend_info() -> None:
    from mixprec_torch.plugin import mixprec_register_backends

    (info,) = mixprec_register_backends()
    assert info == BackendInfo(
        name="torch",
        framework="torch",
        api_module="mixprec_torch",
        extra="torch",
        description=info.description,
    )
    assert info.description


def test_facade_forwards_to_the_backend() -> None:
    for name in mixprec_torch.__all__:
        assert getattr(mpt, name) is getattr(mixprec_torch, name), name
    assert callable(mpt.wrap) and callable(mpt.capabilities)
    assert mixprec.load_backend("torch") is mixprec_torch


def test_conformance_adapter_follows_the_protocol() -> None:
    adapter = mpt.conformance_adapter()
    assert isinstance(adapter, ConformanceAdapter)
    assert adapter.name == "torch" and set(adapter.supported_ops()) == set(mixprec.OP_FAMILIES)
    assert adapter.op_dtype(mixprec.get_policy("O1-bf16"), "softmax", "bfloat16") == "float32"
    assert adapter.op_dtype(mixprec.get_policy("O1-bf16"), "linear", "float32") == "bfloat16"
