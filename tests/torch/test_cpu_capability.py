"""Whether bfloat16 is fast on this CPU: the probe's rules, and the probe against a matmul.

``mixprec_torch.devices`` calls bfloat16 fast where the CPU has AVX512-BF16 or AMX-BF16 *and*
oneDNN may use it (``ONEDNN_MAX_CPU_ISA``/``DNNL_MAX_CPU_ISA`` can cap it below, as the
suite's AVX2 emulation does). The rules are a pure function, checked here for CPUs this
machine is not; the ``cpu_isa`` test checks the probe's verdict for this CPU against a
bfloat16 and a float32 matmul, and runs again under the AVX2 emulation (tests/isa.py).
"""

from __future__ import annotations

import time

import isa
import pytest

torch = pytest.importorskip("torch")

import mixprec.torch as mpt  # noqa: E402
from mixprec_torch.devices import cpu_capability, onednn_isa_cap  # noqa: E402

pytestmark = pytest.mark.torch

CAP = "ONEDNN_MAX_CPU_ISA"


@pytest.mark.parametrize(
    ("flags", "cap", "fast"),
    [
        ({"avx2", "f16c"}, None, ()),  # an AVX2-only CPU
        ({"avx512f", "avx512_vnni"}, None, ()),  # AVX512 without its bfloat16 extension
        ({"avx512f", "avx512_bf16"}, None, ("bfloat16",)),  # Zen 4, Cooper Lake
        ({"avx512f", "avx512_bf16"}, "AVX2", ()),  # the suite's AVX2 emulation
        ({"avx512f", "avx512_bf16"}, "AVX512_CORE", ()),  # AVX512 without its bf16 kernels
        ({"avx512f", "avx512_bf16"}, "AVX512_CORE_BF16", ("bfloat16",)),
        ({"avx512_bf16", "amx_bf16", "amx_tile"}, "AVX512_CORE_BF16", ("bfloat16",)),
        ({"amx_bf16", "amx_tile"}, "AVX512_CORE_BF16", ()),  # AMX alone needs the AMX ISA
        ({"avx512_bf16", "amx_bf16", "avx512_fp16"}, None, ("bfloat16", "float16")),  # SPR
        ({"avx512_bf16", "avx512_fp16", "amx_fp16"}, "AVX512_CORE_BF16", ("bfloat16",)),
        ({"avx512_bf16", "avx512_fp16"}, "AVX512_CORE_AMX", ("bfloat16", "float16")),  # AMX ⊇ FP16
    ],
)
def test_fast_dtypes_follow_the_flags_and_the_onednn_cap(
    flags: set[str], cap: str | None, fast: tuple[str, ...]
) -> None:
    cpu = cpu_capability(frozenset(flags), None if cap is None else (CAP, cap))
    assert cpu.compute_dtypes == ("float32", "bfloat16", "float16")  # torch computes all
    assert cpu.fast_dtypes == fast


def test_the_note_names_what_is_missing_and_why() -> None:
    avx2 = cpu_capability(frozenset({"avx2"}), None, True, "AVX2").note
    assert avx2 == (
        "no AVX512-BF16 or AMX-BF16: bfloat16 matmuls are emulated, far slower than float32; "
        "ATen AVX2"
    )
    capped = cpu_capability(frozenset({"avx512_bf16"}), ("DNNL_MAX_CPU_ISA", "AVX2")).note
    assert capped.startswith("the CPU has avx512_bf16 but DNNL_MAX_CPU_ISA=AVX2 keeps oneDNN")
    fast = cpu_capability(frozenset({"avx512_bf16"}), None, True, "AVX512").note
    assert fast == "bfloat16 fast: avx512_bf16; ATen AVX512"
    no_kernels = cpu_capability(frozenset({"avx512_bf16"}), None, onednn_bf16=False)
    assert no_kernels.fast_dtypes == () and "oneDNN runs no bfloat16 kernels" in no_kernels.note


@pytest.mark.parametrize(
    ("env", "cap"),
    [
        ({}, None),
        ({"DNNL_MAX_CPU_ISA": "AVX2"}, ("DNNL_MAX_CPU_ISA", "AVX2")),
        ({"ONEDNN_MAX_CPU_ISA": "avx512_core_bf16"}, (CAP, "AVX512_CORE_BF16")),
        ({CAP: "AVX2", "DNNL_MAX_CPU_ISA": "AVX512_CORE_AMX"}, (CAP, "AVX2")),  # ONEDNN_ first
        ({CAP: "ALL"}, None),
        ({CAP: "DEFAULT"}, None),
        ({CAP: "NO_SUCH_ISA"}, None),  # oneDNN ignores a name it does not know
    ],
)
def test_onednn_cap_is_read_as_onednn_reads_it(
    env: dict[str, str], cap: tuple[str, str] | None
) -> None:
    assert onednn_isa_cap(env) == cap


def _best_ms(a: torch.Tensor, b: torch.Tensor, repeat: int = 5) -> float:
    a @ b  # warm-up: oneDNN builds its kernel on the first call
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return best * 1e3


@pytest.mark.cpu_isa
def test_the_probe_agrees_with_a_bfloat16_matmul_on_this_cpu() -> None:
    """Not a speed target: on one thread a 256² bfloat16 matmul takes 70-120× the float32 one
    where it is emulated, 0.5× with AVX512-BF16 (Zen 4), so the fastest of five tells the two
    apart under any load."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 256, generator=gen), torch.randn(256, 256, generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a busy machine two threads wait on each other for ms
    try:
        ratio = _best_ms(a.bfloat16(), b.bfloat16()) / _best_ms(a, b)
    finally:
        torch.set_num_threads(threads)
    cpu = mpt.capabilities().device("cpu")
    where = f"{isa.describe()}; probe: {cpu.describe()}"
    assert ("bfloat16" in cpu.fast_dtypes) == (ratio < 1.0), f"bf16/fp32 = {ratio:.2f} ({where})"
