"""The bfloat16 kernel probe (:mod:`mixprec_mxnet.bf16_kernels`): its verdict is what really happens
when each op runs in bfloat16 on this CPU, and ``auto`` picks bfloat16 only where it is fast.

Every expectation here depends on the CPU (``cpu_isa``): on an AVX512 machine
``tests/test_cpu_isa.py`` runs them again as on an AVX2-only CPU (``DNNL_MAX_CPU_ISA=AVX2``),
and the AVX512-without-BF16 case runs below in a subprocess (``DNNL_MAX_CPU_ISA=AVX512_CORE``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import warnings
from collections.abc import Callable

import isa
import pytest

mx = pytest.importorskip("mxnet")

from _mx_nets import cnn  # noqa: E402
from mxnet import autograd, gluon, nd  # noqa: E402

import mixprec  # noqa: E402
import mixprec.mxnet as mpx  # noqa: E402
from mixprec_mxnet.bf16_kernels import (  # noqa: E402
    GEMM_OPS,
    PROBED_OPS,
    Bf16IslandWarning,
    bf16_cpu_is_fast,
    missing_bf16_cpu_ops,
)
from mixprec_mxnet.dtypes import cast  # noqa: E402

pytestmark = [pytest.mark.mxnet, pytest.mark.cpu_isa]


def _bf16(*shape: int) -> nd.NDArray:
    return cast(nd.random.uniform(shape=shape), "bfloat16")


#: Each probed op as a Gluon layer calls it, at a layer's size (not the probe's tiny call).
LAYER_CALLS: dict[str, Callable[[nd.NDArray], nd.NDArray]] = {
    "FullyConnected": lambda x: nd.FullyConnected(
        x, _bf16(32, 8 * 6 * 6), _bf16(32), num_hidden=32
    ),
    "Convolution": lambda x: nd.Convolution(
        x, _bf16(16, 8, 3, 3), _bf16(16), kernel=(3, 3), num_filter=16, pad=(1, 1)
    ),
    "Deconvolution": lambda x: nd.Deconvolution(
        x, _bf16(8, 4, 3, 3), no_bias=True, kernel=(3, 3), num_filter=4
    ),
    "BatchNorm": lambda x: nd.BatchNorm(
        x, nd.ones((8,)), nd.zeros((8,)), nd.zeros((8,)), nd.ones((8,))
    ),
    "_contrib_BatchNormWithReLU": lambda x: nd.contrib.BatchNormWithReLU(
        x, nd.ones((8,)), nd.zeros((8,)), nd.zeros((8,)), nd.ones((8,))
    ),
    "Pooling": lambda x: nd.Pooling(x, kernel=(2, 2), stride=(2, 2), pool_type="max"),
    "Activation": lambda x: nd.Activation(x, act_type="relu"),
    "LeakyReLU": lambda x: nd.LeakyReLU(x, act_type="leaky", slope=0.1),
}


def _runs_in_bfloat16(call: Callable[[nd.NDArray], nd.NDArray]) -> bool:
    x = _bf16(4, 8, 6, 6)
    x.attach_grad()
    try:
        with autograd.record():
            y = call(x)
        y.backward()
        x.grad.wait_to_read()
    except mx.MXNetError:
        with contextlib.suppress(mx.MXNetError):
            nd.waitall()  # collect the engine's copy of the error
        return False
    return True


def test_the_probe_says_what_each_op_does_at_a_layers_size() -> None:
    """The FullyConnected probe once reshaped 32 elements to (2, 8) and failed on every CPU."""
    missing = missing_bf16_cpu_ops()
    assert missing is missing_bf16_cpu_ops()  # probed once per process
    assert set(LAYER_CALLS) == set(PROBED_OPS)
    found = {op: _runs_in_bfloat16(call) for op, call in LAYER_CALLS.items()}
    assert {op for op, ran in found.items() if not ran} == missing


def test_auto_picks_bfloat16_exactly_where_the_cpu_runs_it_natively() -> None:
    """Fast = the GEMM/conv kernels exist and the CPU has AVX512-BF16 or AMX (and oneDNN may
    use them); an AVX2 CPU (or the AVX2 emulation) has no kernel at all."""
    flags = isa.cpu_flags()
    native = bool({"avx512_bf16", "amx_bf16"} & flags) and not isa.emulating_avx2()
    if "avx512f" not in flags or isa.emulating_avx2():
        assert set(GEMM_OPS) <= missing_bf16_cpu_ops()
    assert bf16_cpu_is_fast() == native
    caps = mpx.capabilities()
    assert caps.preferred_lowp("cpu") == ("bfloat16" if native else None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = mpx.Trainer(cnn(), "sgd", {"learning_rate": 0.1})  # policy="auto"
    assert trainer.policy.compute == ("bfloat16" if native else "float32")
    said_float32 = [w for w in caught if "no fast float16/bfloat16" in str(w.message)]
    assert len(said_float32) == (0 if native else 1)


def test_one_warning_names_the_island_ops_and_the_cpu_feature() -> None:
    missing = missing_bf16_cpu_ops()
    if not missing:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Bf16IslandWarning)
            mpx.Trainer(cnn(), "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
        return
    with pytest.warns(Bf16IslandWarning) as caught:
        mpx.Trainer(cnn(), "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
    assert len(caught) == 1
    message = str(caught[0].message)
    assert all(op in message for op in missing)
    assert "AVX512" in message and "float32 islands" in message and "policy='auto'" in message


AVX512_CORE_CHECK = """
import warnings
import mxnet as mx
from mxnet import gluon
import mixprec.mxnet as mpx
from mixprec_mxnet.bf16_kernels import Bf16IslandWarning, bf16_cpu_is_fast, missing_bf16_cpu_ops
assert missing_bf16_cpu_ops() == frozenset(), missing_bf16_cpu_ops()
assert not bf16_cpu_is_fast()
assert mpx.capabilities().preferred_lowp("cpu") is None
net = gluon.nn.Dense(4, in_units=8)
net.initialize()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    trainer = mpx.Trainer(net, "sgd", policy="auto")
assert trainer.policy.compute == "float32", trainer.policy
net = gluon.nn.Dense(4, in_units=8)
net.initialize()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    mpx.Trainer(net, "sgd", policy="O2-bf16")
texts = [str(w.message) for w in caught if issubclass(w.category, Bf16IslandWarning)]
assert len(texts) == 1 and "AVX512-BF16" in texts[0] and "slower than float32" in texts[0], texts
print("ok")
"""


@pytest.mark.skipif(
    "avx512f" not in isa.cpu_flags() or isa.emulating_avx2(),
    reason=f"this CPU ({isa.describe()}) has no AVX512 to run oneDNN's emulated bfloat16 on",
)
def test_an_avx512_cpu_without_bf16_instructions_runs_bf16_slowly_and_says_so() -> None:
    """oneDNN capped at AVX512_CORE (a Skylake/Cascade Lake CPU) has every bfloat16 kernel,
    emulated and ~2.5x slower than float32: no islands, but ``auto`` is float32 and an
    explicit bfloat16 policy warns once."""
    env = {**os.environ, "DNNL_MAX_CPU_ISA": "AVX512_CORE", "PYTHONWARNINGS": "ignore"}
    run = subprocess.run(
        [sys.executable, "-c", AVX512_CORE_CHECK],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr[-3000:]


def test_no_onednn_refuses_bfloat16_naming_the_build_and_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An MXNet build without oneDNN has no bfloat16 on CPU: refused up front, nothing
    changed, and ``auto`` falls back to float32."""
    from mixprec_mxnet import devices

    features = mx.runtime.Features()

    class NoOneDNN:
        def is_enabled(self, name: str) -> bool:
            return False if name.upper() in ("MKLDNN", "ONEDNN") else features.is_enabled(name)

    monkeypatch.setattr(mx.runtime, "Features", NoOneDNN)
    devices.has_onednn.cache_clear()
    devices.capabilities.cache_clear()
    try:
        net = cnn()
        before = {k: v.data().asnumpy().copy() for k, v in net.collect_params().items()}
        with pytest.raises(mixprec.UnsupportedDtypeError, match=r"oneDNN.*policy='O0'"):
            mpx.Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
        after = {k: v.data() for k, v in net.collect_params().items()}
        assert all(after[k].dtype == before[k].dtype for k in before)
        fresh = gluon.nn.Dense(4, in_units=8)
        fresh.initialize()
        with pytest.warns(mixprec.MixprecWarning):
            trainer = mpx.Trainer(fresh, "sgd", policy="auto")
        assert trainer.policy.compute == "float32"
    finally:
        monkeypatch.undo()
        devices.has_onednn.cache_clear()
        devices.capabilities.cache_clear()
