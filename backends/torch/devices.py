"""What this PyTorch build and its devices can compute in, for ``auto`` and for wrap's checks.

The CPU computes every floating dtype (float16 GEMMs run, slowly, through the generic
kernels). Low precision is *fast* on a CPU only where oneDNN, which runs torch's CPU
matmuls and convolutions, can use the instructions for it: bfloat16 needs AVX512-BF16 or
AMX-BF16, float16 AVX512-FP16 or AMX-FP16. Three things decide that, and all are read:

- the CPU's flags (``/proc/cpuinfo``): whether the instructions exist;
- ``ONEDNN_MAX_CPU_ISA`` / ``DNNL_MAX_CPU_ISA``: a cap that keeps oneDNN below them (the
  AVX2 emulation of the test suite, or a container that sets it). Under
  ``ONEDNN_MAX_CPU_ISA=AVX2`` a bfloat16 512² matmul took 20-45× an float32 one on an
  AVX512-BF16 Zen 4, against 0.37× uncapped: the flags alone would call it fast;
- whether this build's oneDNN runs bfloat16 at all at its effective ISA
  (:func:`~mixprec_torch.torch_private.onednn_runs_bfloat16`).

ATen's own vector ISA (``torch.backends.cpu.get_cpu_capability()``, set down by
``ATEN_CPU_CAPABILITY``) is reported in the note but does not decide: with
``ATEN_CPU_CAPABILITY=avx2`` alone the bfloat16 matmuls still run on AVX512-BF16 (0.37× float32)
and an autocast MLP step stayed at 0.54× float32 on that CPU.

A CUDA device computes bfloat16 from compute capability 8.0 (Ampere) and float16
everywhere; both are fast on 8.0+, float16 alone on 7.x (tensor cores). ``auto`` picks
bfloat16 before float16 among the fast dtypes (:meth:`mixprec.Capabilities.preferred_lowp`).
:func:`cpu_capability` and :func:`cuda_capability` are pure functions of those facts.

Every FP8 recipe runs on both, emulated exactly where ``torch._scaled_mm`` does not run it
(:mod:`mixprec_torch.fp8.numerics`), so both list all of them.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Set
from pathlib import Path

import torch

from mixprec.kit import FP8_RECIPES, Capabilities, DeviceCapability

from .torch_private import onednn_runs_bfloat16

__all__ = [
    "capabilities",
    "cpu_capability",
    "cpu_flags",
    "cuda_capability",
    "device_capability",
    "device_key",
    "onednn_isa_cap",
]

_ALL = ("float32", "bfloat16", "float16")

#: oneDNN's ISA names (``ONEDNN_MAX_CPU_ISA`` values) and their bit masks (``dnnl_cpu_isa_t``):
#: an ISA includes another when its mask covers the other's bits.
ONEDNN_ISAS: Mapping[str, int] = {
    "SSE41": 0x1,
    "AVX": 0x3,
    "AVX2": 0x7,
    "AVX2_VNNI": 0xF,
    "AVX2_VNNI_2": 0x1F,
    "AVX512_CORE": 0x27,
    "AVX512_CORE_VNNI": 0x67,
    "AVX512_CORE_BF16": 0xE7,
    "AVX10_1_512": 0x1EF,
    "AVX512_CORE_FP16": 0x1EF,
    "AVX10_1_512_AMX": 0xFEF,
    "AVX512_CORE_AMX": 0xFEF,
    "AVX10_1_512_AMX_FP16": 0x1FEF,
    "AVX512_CORE_AMX_FP16": 0x1FEF,
}

#: dtype -> ((CPU flag, the oneDNN ISA that uses it), ...): any one pair makes the dtype fast
_FAST_CPU = {
    "bfloat16": (("avx512_bf16", "AVX512_CORE_BF16"), ("amx_bf16", "AVX512_CORE_AMX")),
    "float16": (("avx512_fp16", "AVX512_CORE_FP16"), ("amx_fp16", "AVX512_CORE_AMX_FP16")),
}
_FEATURE = {"bfloat16": "AVX512-BF16 or AMX-BF16", "float16": "AVX512-FP16 or AMX-FP16"}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags from ``/proc/cpuinfo`` (empty where it does not exist)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def onednn_isa_cap(environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """The cap on oneDNN's ISA, as ``(variable, ISA name)``, or None when there is none.

    oneDNN reads ``ONEDNN_MAX_CPU_ISA`` first, then ``DNNL_MAX_CPU_ISA``; ``ALL``,
    ``DEFAULT`` and names it does not know leave it uncapped.
    """
    env = os.environ if environ is None else environ
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        value = env.get(var, "").strip().upper()
        if value:
            return (var, value) if value in ONEDNN_ISAS else None
    return None


def cpu_capability(
    flags: Set[str],
    isa_cap: tuple[str, str] | None = None,
    onednn_bf16: bool = True,
    aten_isa: str = "",
) -> DeviceCapability:
    """The CPU's entry from its facts: flags, the oneDNN ISA cap (:func:`onednn_isa_cap`),
    whether the build's oneDNN runs bfloat16 at all, and ATen's vector ISA (reported only).
    """
    fast: list[str] = []
    notes: list[str] = []
    for dtype, ways in _FAST_CPU.items():
        present = [(flag, isa) for flag, isa in ways if flag in flags]
        usable = [
            flag
            for flag, isa in present
            if isa_cap is None or ONEDNN_ISAS[isa_cap[1]] & ONEDNN_ISAS[isa] == ONEDNN_ISAS[isa]
        ]
        if dtype == "bfloat16" and usable and not onednn_bf16:
            notes.append("this torch's oneDNN runs no bfloat16 kernels: bfloat16 is emulated")
        elif usable:
            fast.append(dtype)
            notes.append(f"{dtype} fast: {', '.join(usable)}")
        elif present and isa_cap is not None:
            have = ", ".join(flag for flag, _ in present)
            notes.append(
                f"the CPU has {have} but {isa_cap[0]}={isa_cap[1]} keeps oneDNN from using it: "
                f"{dtype} matmuls are emulated, far slower than float32"
            )
        elif dtype == "bfloat16":
            notes.append(
                f"no {_FEATURE[dtype]}: {dtype} matmuls are emulated, far slower than float32"
            )
    if aten_isa:
        notes.append(f"ATen {aten_isa}")
    return DeviceCapability("cpu", _ALL, tuple(fast), "; ".join(notes), FP8_RECIPES)


def cuda_capability(index: int, major: int, minor: int) -> DeviceCapability:
    """A CUDA device's entry from its compute capability ``(major, minor)``."""
    cc = major * 10 + minor
    compute = ("float32", "bfloat16", "float16") if cc >= 80 else ("float32", "float16")
    fast = ("bfloat16", "float16") if cc >= 80 else ("float16",) if cc >= 70 else ()
    if cc >= 80:
        note = f"compute capability {major}.{minor}"
    else:
        lacks = "no bfloat16 (needs 8.0, Ampere)"
        if cc < 70:
            lacks += ", no float16 tensor cores (need 7.0, Volta)"
        note = f"compute capability {major}.{minor}: {lacks}"
    return DeviceCapability(f"cuda:{index}", compute, fast, note, FP8_RECIPES)


def _cpu() -> DeviceCapability:
    aten = str(torch.backends.cpu.get_cpu_capability())
    return cpu_capability(cpu_flags(), onednn_isa_cap(), onednn_runs_bfloat16(), aten)


def _cuda(index: int) -> DeviceCapability:
    major, minor = torch.cuda.get_device_capability(index)
    return cuda_capability(index, major, minor)


@functools.cache
def capabilities() -> Capabilities:
    """The CPU and every visible CUDA device, with the dtypes each computes in and runs fast.

    Cached: devices do not change within a process.
    """
    devices = [_cpu()]
    if torch.cuda.is_available():
        devices.extend(_cuda(i) for i in range(torch.cuda.device_count()))
    return Capabilities("torch", torch.__version__, tuple(devices))


def device_key(device: torch.device) -> str:
    """The name ``capabilities()`` uses for ``device``: ``"cpu"`` or ``"cuda:<index>"``."""
    if device.type == "cuda":
        index = device.index if device.index is not None else int(torch.cuda.current_device())
        return f"cuda:{index}"
    return device.type


def device_capability(device: torch.device) -> DeviceCapability | None:
    """The entry for ``device``, or None for a device this backend cannot compute on
    (``meta``, or a device type it does not know)."""
    key = device_key(device)
    return next((cap for cap in capabilities().devices if cap.device == key), None)
