"""The Gluon backend as mixprec sees it: plugin, capabilities, conformance adapter."""

from __future__ import annotations

import subprocess
import sys

import pytest

mx = pytest.importorskip("mxnet")

import mixprec  # noqa: E402
import mixprec_mxnet  # noqa: E402
from mixprec.engine.plugins import backend_info, load_backend  # noqa: E402
from mixprec.kit import get_policy  # noqa: E402
from mixprec.testing.protocol import ConformanceAdapter, ConformanceTrainer  # noqa: E402
from mixprec_mxnet.bf16_kernels import bf16_cpu_is_fast, missing_bf16_cpu_ops  # noqa: E402

pytestmark = pytest.mark.mxnet


def test_plugin_module_does_not_import_mxnet() -> None:
    code = (
        "import sys, mixprec_mxnet.plugin as p\n"
        "info, = p.mixprec_register_backends()\n"
        "assert 'mxnet' not in sys.modules, 'plugin imported mxnet'\n"
        "print(info.name, info.api_module, info.extra)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["mxnet", "mixprec_mxnet", "mxnet"]


def test_registered_through_the_entry_point() -> None:
    assert backend_info("mxnet").api_module == "mixprec_mxnet"
    assert load_backend("mxnet") is mixprec_mxnet
    import mixprec.mxnet as facade

    assert facade.Trainer is mixprec_mxnet.Trainer


@pytest.mark.cpu_isa
def test_capabilities_report_bf16_on_a_onednn_cpu() -> None:
    """bfloat16 is supported with oneDNN; fast (auto's pick) only with native GEMM kernels."""
    caps = mixprec_mxnet.capabilities()
    cpu = caps.device("cpu")
    assert caps.backend == "mxnet" and caps.framework_version == mx.__version__
    if mx.runtime.Features().is_enabled("MKLDNN"):
        assert cpu.compute_dtypes == ("float32", "bfloat16")
        native = bf16_cpu_is_fast()  # checked against the CPU's flags in test_mx_kernels.py
        assert native <= (not {"FullyConnected", "Convolution"} & missing_bf16_cpu_ops())
        assert caps.preferred_lowp("cpu") == ("bfloat16" if native else None)
        assert cpu.fast_dtypes == (("bfloat16",) if native else ())
    assert "float16" not in cpu.compute_dtypes
    assert len(caps.devices) == 1 + mx.context.num_gpus()


def test_conformance_adapter_follows_the_protocol() -> None:
    adapter = mixprec_mxnet.conformance_adapter()
    assert isinstance(adapter, ConformanceAdapter) and adapter.name == "mxnet"
    policy = get_policy("O2-bf16", loss_scale="dynamic")
    trainer = adapter.make_trainer(policy)
    assert isinstance(trainer, ConformanceTrainer)
    trainer.step()
    before = (trainer.params(), trainer.master_params(), trainer.optimizer_state())
    scale = trainer.loss_scale()
    trainer.step(inject_inf=True)
    assert (trainer.params(), trainer.master_params(), trainer.optimizer_state()) == before
    assert trainer.skipped_steps() == 1 and trainer.loss_scale() == scale / 2
    assert trainer.saved_param_dtypes() == {"float32"}
    blob = trainer.checkpoint()
    fresh = adapter.make_trainer(policy, seed=1)
    fresh.restore(blob)
    assert fresh.master_params() == trainer.master_params()
    assert fresh.loss_scale() == trainer.loss_scale()
    assert fresh.step() == trainer.step()
    assert fresh.params() == trainer.params()


def test_float16_ops_are_refused_on_cpu() -> None:
    adapter = mixprec_mxnet.conformance_adapter()
    with pytest.raises(mixprec.UnsupportedDtypeError, match="bfloat16"):
        adapter.op_dtype(get_policy("O1"), "linear", "float16")
    with pytest.raises(mixprec.UnsupportedDtypeError):
        adapter.make_trainer(get_policy("O2"))


def test_cast_into_rounds_to_nearest_into_the_target() -> None:
    from mixprec_mxnet.dtypes import cast, cast_into, dtype_of

    x = mx.nd.array([1.0 + 2**-8 + 2**-10, -(1.0 + 3 * 2**-8), 3.0], dtype="float32")
    out = cast(mx.nd.zeros((3,)), "bfloat16")
    assert cast_into(x, out) is out and dtype_of(out) == "bfloat16"
    # rounds to nearest (1 + 2**-7 up, not truncated down to 1.0), as cast() does
    assert cast(out, "float32").asnumpy().tolist() == [1.0 + 2**-7, -(1.0 + 2**-6), 3.0]
    assert (
        cast(out, "float32").asnumpy().tolist()
        == cast(cast(x, "bfloat16"), "float32").asnumpy().tolist()
    )
