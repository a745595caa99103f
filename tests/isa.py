"""The CPU's instruction sets, for tests whose expectation depends on the CPU.

Some behaviour depends on the CPU: whether MXNet's oneDNN has bfloat16 kernels, whether
torch's bfloat16 matmuls are fast, what ``auto`` resolves to. Those tests carry the
``cpu_isa`` marker and assert what is right for the CPU they run on, found by a probe,
never a fixed list. On a CPU with AVX512 the other branch can run too: oneDNN honours
``DNNL_MAX_CPU_ISA=AVX2`` (MXNet then lacks every bfloat16 kernel, exactly as on an
AVX2-only CPU) and torch honours ``ATEN_CPU_CAPABILITY=avx2`` with ``ONEDNN_MAX_CPU_ISA``.
``tests/test_cpu_isa.py`` re-runs every ``cpu_isa`` test in a subprocess under that
emulation. The reverse is impossible: an AVX2-only CPU cannot run the fast branch.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

#: The environment that makes an AVX512 CPU behave as an AVX2-only one, for oneDNN (MXNet's
#: and torch's) and for ATen's vectorised kernels. Set before the process starts.
AVX2_ENV = {"DNNL_MAX_CPU_ISA": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The feature flags of ``/proc/cpuinfo`` (empty where it does not exist)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def emulating_avx2() -> bool:
    """Whether this process runs under :data:`AVX2_ENV`, or any of its variables (oneDNN
    reads ``ONEDNN_MAX_CPU_ISA`` as well as ``DNNL_MAX_CPU_ISA``)."""
    return any(os.environ.get(var, "").upper() == value.upper() for var, value in AVX2_ENV.items())


def can_emulate_avx2() -> bool:
    """Whether the CPU has AVX512 code paths that :data:`AVX2_ENV` can switch off."""
    return "avx512f" in cpu_flags() and not emulating_avx2()


def describe() -> str:
    """One line naming the CPU's bfloat16-relevant flags, for skip reasons and reports."""
    wanted = ("avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16")
    have = [f for f in wanted if f in cpu_flags()] or ["none of avx512f/avx512_bf16/amx_bf16"]
    return ", ".join(have) + (" (emulating AVX2)" if emulating_avx2() else "")
