"""The CUDA paths, checked without a GPU on a simulated CUDA device (``_fake_cuda.py``).

Torch's own CUDA autocast kernels run for fake CUDA tensors, so the ``torch-autocast-cuda``
table is checked against ``torch.autocast("cuda")`` itself, and a wrapped model's forward
dtypes on ``cuda:0`` against the same model's on the CPU. ``auto`` and the refusals are
checked per compute capability. What needs a real GPU (values, backward, the optimizer
step, speed) runs in ``make gpu-check`` (docs/benchmarks.md).
"""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

from _fake_cuda import Block, cpu_flow, dtype_flow, fake_cuda, to_fake_cuda  # noqa: E402
from torch import nn  # noqa: E402

import mixprec  # noqa: E402
import mixprec.torch as mpt  # noqa: E402
from mixprec.errors import MixprecWarning, UnsupportedDtypeError  # noqa: E402
from mixprec_torch.devices import cuda_capability, device_key  # noqa: E402
from mixprec_torch.o1.probes import autocast_dtypes  # noqa: E402
from mixprec_torch.presets import torch_autocast_policy, torch_autocast_presets  # noqa: E402

pytestmark = pytest.mark.torch

LOWP = {"float16": torch.float16, "bfloat16": torch.bfloat16}


# ------------------------------------------------------------ the compute capability table


@pytest.mark.parametrize(
    ("cc", "compute", "fast", "lacks"),
    [
        ((6, 1), ("float32", "float16"), (), "no bfloat16 (needs 8.0, Ampere), no float16 tensor"),
        ((7, 0), ("float32", "float16"), ("float16",), "no bfloat16 (needs 8.0, Ampere)"),
        ((7, 5), ("float32", "float16"), ("float16",), "no bfloat16 (needs 8.0, Ampere)"),
        ((8, 0), ("float32", "bfloat16", "float16"), ("bfloat16", "float16"), None),
        ((8, 9), ("float32", "bfloat16", "float16"), ("bfloat16", "float16"), None),
        ((9, 0), ("float32", "bfloat16", "float16"), ("bfloat16", "float16"), None),
        ((12, 0), ("float32", "bfloat16", "float16"), ("bfloat16", "float16"), None),
    ],
)
def test_cuda_capability_table(
    cc: tuple[int, int], compute: tuple[str, ...], fast: tuple[str, ...], lacks: str | None
) -> None:
    cap = cuda_capability(1, *cc)
    assert (cap.device, cap.compute_dtypes, cap.fast_dtypes) == ("cuda:1", compute, fast)
    assert cap.note.startswith(f"compute capability {cc[0]}.{cc[1]}")
    assert (lacks is None and ":" not in cap.note) or (lacks is not None and lacks in cap.note)


# ------------------------------------------------------------------ the torch-autocast table


@pytest.mark.parametrize("compute", ["float16", "bfloat16"])
def test_cuda_preset_decides_what_cuda_autocast_produces(compute: str) -> None:
    """Every family's probes under ``torch.autocast("cuda", compute)`` on fake CUDA tensors,
    for all-float32, all-bfloat16, all-float16 and mixed inputs: the preset decides the dtype
    autocast produced, wherever autocast runs the call at all."""
    policy = mixprec.get_policy("torch-autocast-cuda", compute=compute)
    with fake_cuda():
        produced = autocast_dtypes("cuda", LOWP[compute], LOWP[compute])
    checked = set()
    for (family, index, inputs), dtype in produced.items():
        if dtype is None:  # the op refused these inputs under autocast (as on a GPU)
            continue
        assert policy.decide(family, inputs).dtype == dtype, (family, index, inputs)
        checked.add(family)
    # autocast("cuda") raises for every input of a family only where the preset bans it
    assert {family for family, _, _ in produced} - checked == set(policy.ops.banned)
    assert len(checked) >= 40


def test_torch_autocast_follows_the_machine() -> None:
    if torch.cuda.is_available():
        pytest.skip("a real GPU: torch-autocast is CUDA's outside the simulation too")
    assert mixprec.get_policy("torch-autocast") == torch_autocast_policy("cpu")
    with fake_cuda():
        assert torch_autocast_presets()["torch-autocast"] == torch_autocast_policy("cuda")
        assert mixprec.get_policy("torch-autocast") == torch_autocast_policy("cuda")
    assert mixprec.get_policy("torch-autocast") == torch_autocast_policy("cpu")  # nothing stuck
    assert [d.device for d in mpt.capabilities().devices] == ["cpu"]


# --------------------------------------------------------------- a wrapped model's dtype flow


def cuda_flow(policy: str | None, autocast: torch.dtype | None = None) -> dict[str, tuple]:
    """The flow on the fake ``cuda:0``: wrapped with ``policy``, or plain under
    ``torch.autocast("cuda", autocast)``."""
    with fake_cuda():
        with torch.device("meta"):
            block = Block().train()
        model = to_fake_cuda(block)
        x = torch.empty(2, 3, 6, 6, device="cuda")
        if policy is None:
            with torch.autocast("cuda", dtype=autocast):
                return dtype_flow(model, x)
        assert all(p.device.type == "cuda" for p in model.parameters())
        return dtype_flow(mpt.wrap(model, policy=policy), x)


@pytest.mark.parametrize(
    "policy", ["O1", "O1-bf16", "O2", "O2-bf16", "O3-bf16", "torch-autocast-cuda"]
)
def test_wrapped_model_has_the_same_dtypes_on_cuda_as_on_cpu(policy: str) -> None:
    """The policy decides, not the device: O1 intercepts a different set of families on
    CUDA (CUDA autocast already runs softmax and layer_norm in float32, CPU autocast does
    not), and the result must be the same dtype at every module."""
    on_cuda = cuda_flow(policy)
    assert on_cuda == cpu_flow(policy)
    lowp = "torch.bfloat16" if "bf16" in policy else "torch.float16"
    assert on_cuda["fc"][1] == lowp  # the linear ran in low precision on cuda
    if policy.startswith("O1"):
        assert on_cuda["bn"] == ("torch.float32", "torch.float32")  # pinned: autocast off


def test_torch_autocast_cuda_preset_reproduces_cuda_autocast() -> None:
    assert cuda_flow("torch-autocast-cuda") == cuda_flow(None, torch.float16)


# ------------------------------------------------------------ auto and the refusals per GPU


def _wrap_logged(caplog: pytest.LogCaptureFixture, policy: str | None) -> str:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mixprec.torch"):
        model = to_fake_cuda(nn.Linear(4, 4, device="meta"))
        mpt.wrap(model) if policy is None else mpt.wrap(model, policy=policy)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "mixprec.torch"]
    return line


@pytest.mark.parametrize(("cc", "resolved"), [((8, 6), "O1-bf16"), ((7, 5), "O1")])
def test_auto_resolves_per_compute_capability(
    cc: tuple[int, int], resolved: str, caplog: pytest.LogCaptureFixture
) -> None:
    with fake_cuda(*cc):
        assert _wrap_logged(caplog, None) == f"mixprec.torch.wrap: policy {resolved} on cuda:0"


def test_auto_on_a_gpu_without_fast_low_precision_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with fake_cuda(6, 1), pytest.warns(MixprecWarning, match=r"compute capability 6\.1") as got:
        assert _wrap_logged(caplog, "auto") == "mixprec.torch.wrap: policy O0 on cuda:0"
    assert "no float16 tensor cores (need 7.0, Volta)" in str(got[0].message)


@pytest.mark.parametrize("policy", ["O1-bf16", "O2-bf16", "bf16-mixed"])
def test_bfloat16_on_a_gpu_before_ampere_is_refused_with_the_fix(policy: str) -> None:
    with fake_cuda(7, 5):
        model = to_fake_cuda(nn.Sequential(nn.Linear(4, 4, device="meta")))
        with pytest.raises(UnsupportedDtypeError) as refused:
            mpt.wrap(model, policy=policy)
        assert all(p.dtype == torch.float32 for p in model.parameters())  # nothing changed
        assert not hasattr(model, "_mixprec")
    message = str(refused.value)
    assert "needs bfloat16 but cuda:0 (compute capability 7.5: no bfloat16 (needs 8.0" in message
    assert "compute=float16" in message and "'O1' instead of 'O1-bf16'" in message


def test_a_bare_cuda_device_is_the_current_one() -> None:
    with fake_cuda():
        assert device_key(torch.device("cuda")) == "cuda:0"
        assert mpt.capabilities().device("cuda").describe() == (
            "cuda:0: float32, bfloat16, float16 (fast: bfloat16, float16) "
            "(fp8: tensorwise, rowwise, delayed, mxfp8) — compute capability 8.0"
        )
