"""What MXNet can compute in on this machine, and the checks made against it.

MXNet 1.9 runs bfloat16 ``FullyConnected`` and ``Convolution`` on CPU through oneDNN (on an
AVX512-BF16 CPU: about 2.2-2.4x faster than float32 forward, 1.7-1.8x forward+backward; on a
CPU without AVX512 oneDNN has no such kernel at all, which :mod:`.bf16_kernels` probes once per
process) but has no float16 GEMM or convolution on CPU at all; GPUs compute in float16
(MXNet 1.9 has no bfloat16 GPU kernels). Many other CPU ops take bfloat16 through slow
generic kernels (``relu``, ``sigmoid``, element-wise ``+``, ``BatchNorm``: 5-10x slower than
float32), so a bfloat16 policy pays off in nets dominated by matrix products and convolutions.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import mxnet as mx

from mixprec.errors import PolicyError, UnsupportedDtypeError
from mixprec.kit import (
    BFLOAT16,
    FLOAT16,
    FLOAT32,
    Capabilities,
    DeviceCapability,
    Policy,
    get_policy,
    is_low_precision,
    resolve_for_device,
)

from .bf16_kernels import bf16_cpu_is_fast

__all__ = ["capabilities", "check_policy_dtypes", "device_key", "has_onednn", "resolve_policy"]


@functools.lru_cache(maxsize=1)
def has_onednn() -> bool:
    """Whether this MXNet build has oneDNN (MKLDNN), which provides bfloat16 on CPU."""
    return bool(mx.runtime.Features().is_enabled("MKLDNN"))


def device_key(ctx: Any) -> str:
    """The capability name of an MXNet context: ``"cpu"`` or ``"gpu(0)"``.

    Every CPU context (``mx.cpu(0)``, ``mx.cpu(1)``, ``mx.cpu_pinned()``) is the one CPU.
    """
    if ctx.device_type in ("cpu", "cpu_pinned", "cpu_shared"):
        return "cpu"
    return f"gpu({ctx.device_id})"


def _cpu() -> DeviceCapability:
    """bfloat16 is supported with oneDNN, and *fast* only where the probe finds native
    bfloat16 FullyConnected and Convolution kernels (AVX512-BF16); elsewhere those ops run
    as float32 islands, so a bfloat16 policy runs but ``auto`` picks float32."""
    if not has_onednn():
        return DeviceCapability("cpu", (FLOAT32,), ())
    return DeviceCapability("cpu", (FLOAT32, BFLOAT16), (BFLOAT16,) if bf16_cpu_is_fast() else ())


@functools.lru_cache(maxsize=1)
def capabilities() -> Capabilities:
    """The Gluon backend's devices: the CPU, plus every GPU MXNet sees (float16 there)."""
    devices = [_cpu()]
    for i in range(mx.context.num_gpus()):
        devices.append(DeviceCapability(f"gpu({i})", (FLOAT32, FLOAT16), (FLOAT16,)))
    return Capabilities(backend="mxnet", framework_version=mx.__version__, devices=tuple(devices))


def check_policy_dtypes(
    dtypes: Sequence[str], contexts: Sequence[Any], policy: Policy | None = None
) -> None:
    """Refuse low-precision dtypes the contexts cannot compute in, with the fix.

    :param dtypes: the low-precision dtypes the policy computes or stores parameters in.
    :param contexts: the MXNet contexts the parameters live on.
    :param policy: the policy, to suggest its bfloat16 sibling (``O2`` -> ``O2-bf16``).
    :raises UnsupportedDtypeError: float16 on a CPU context, bfloat16 without oneDNN or on a
        GPU context.
    """
    caps = capabilities()
    for ctx in contexts:
        device = device_key(ctx)
        allowed = caps.device(device).compute_dtypes if device == "cpu" else (FLOAT32, FLOAT16)
        for dtype in dtypes:
            if not is_low_precision(dtype) or dtype in allowed:
                continue
            raise UnsupportedDtypeError(_refusal(dtype, device, ctx, policy))


def _bf16_sibling(policy: Policy | None) -> str:
    """The policy with bfloat16 in place of float16, as a preset name or key spec."""
    if policy is None:
        return "O2-bf16"
    try:
        return str(get_policy(policy, compute=BFLOAT16))
    except PolicyError:
        return "O2-bf16"


def _refusal(dtype: str, device: str, ctx: Any, policy: Policy | None) -> str:
    if device == "cpu" and dtype == FLOAT16:
        return (
            f"the policy computes in float16 but the parameters live on {ctx}: MXNet has no "
            "float16 matrix multiply or convolution on CPU. Use bfloat16 instead: "
            f"policy='{_bf16_sibling(policy)}' (or compute='bfloat16'), or move the net to "
            "a GPU context (mx.gpu(0)) to keep float16"
        )
    if device == "cpu" and dtype == BFLOAT16:
        return (
            f"the policy computes in bfloat16 on {ctx}, but this MXNet build has no oneDNN "
            "(mx.runtime.Features().is_enabled('MKLDNN') is False), which MXNet needs for "
            "bfloat16 on CPU. Install an MXNet build with oneDNN (the PyPI 'mxnet' wheel) or "
            "use policy='O0'"
        )
    return (
        f"the policy computes in {dtype} on {ctx}, which MXNet {mx.__version__} cannot do "
        "(MXNet has bfloat16 kernels on CPU only). Use float16 on GPU, e.g. policy='O2'"
    )


def resolve_policy(spec: Any, contexts: Sequence[mx.Context], **overrides: Any) -> Policy:
    """The concrete policy for parameters on ``contexts``: ``auto`` resolved, dtypes checked.

    :raises UnsupportedDtypeError: the policy computes in a dtype a context cannot (float16
        on CPU: the message suggests the ``-bf16`` preset).
    """

    def check(policy: Policy) -> None:
        check_policy_dtypes([policy.compute, policy.param], contexts, policy)

    device = device_key(contexts[0])
    return resolve_for_device(spec, "mxnet", device, capabilities(), check=check, **overrides)
