"""What this PyTorch build and its devices can compute in, for ``auto`` and for wrap's checks.

The CPU computes every floating dtype (float16 GEMMs run, slowly, through the generic
kernels); bfloat16 counts as *fast* when the CPU has AVX512-BF16 or AMX-BF16, float16 when
it has AVX512-FP16 or AMX-FP16. A CUDA device computes bfloat16 from compute capability
8.0 (Ampere) and float16 everywhere; both are fast on 8.0+, float16 alone on 7.x (tensor
cores). ``auto`` picks bfloat16 before float16 among the fast dtypes
(:meth:`mixprec.Capabilities.preferred_lowp`).

Every FP8 recipe runs on both, emulated exactly where ``torch._scaled_mm`` does not run it
(:mod:`mixprec_torch.fp8_numerics`), so both list all of them.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from mixprec.backend import Capabilities, DeviceCapability
from mixprec.fp8 import FP8_RECIPES

__all__ = ["capabilities", "cpu_flags", "device_capability", "device_key"]

_ALL = ("float32", "bfloat16", "float16")


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


def _cpu() -> DeviceCapability:
    flags = cpu_flags()
    fast = []
    if flags & {"avx512_bf16", "amx_bf16"}:
        fast.append("bfloat16")
    if flags & {"avx512_fp16", "amx_fp16"}:
        fast.append("float16")
    return DeviceCapability("cpu", _ALL, tuple(fast), fp8_recipes=FP8_RECIPES)


def _cuda(index: int) -> DeviceCapability:
    major, minor = torch.cuda.get_device_capability(index)
    cc = major * 10 + minor
    compute = ("float32", "bfloat16", "float16") if cc >= 80 else ("float32", "float16")
    fast = ("bfloat16", "float16") if cc >= 80 else ("float16",) if cc >= 70 else ()
    return DeviceCapability(f"cuda:{index}", compute, fast, fp8_recipes=FP8_RECIPES)


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
