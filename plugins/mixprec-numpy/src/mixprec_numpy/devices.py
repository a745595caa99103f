"""What the NumPy backend can compute in, and the policy checks made against it.

Named ``devices`` like the built-in backends' module: a submodule called ``capabilities``
would replace the package's ``capabilities()`` function once imported.

NumPy has float16 but no bfloat16, so this backend emulates both the way GPUs compute:
inputs are rounded to the low-precision dtype, the matrix product accumulates in float32,
and the result is rounded back. Neither is faster than float32 here, so ``auto`` resolves
to float32 (with mixprec's warning).
"""

from __future__ import annotations

import functools

import numpy as np

from mixprec.errors import UnsupportedDtypeError
from mixprec.kit import (
    BFLOAT16,
    FLOAT16,
    FLOAT32,
    FP8_RECIPES,
    Capabilities,
    DeviceCapability,
    Policy,
    resolve_for_device,
)

__all__ = ["DTYPES", "capabilities", "check_dtype", "resolve_policy"]

DTYPES = (FLOAT32, FLOAT16, BFLOAT16)
"""The dtypes this backend computes and stores in."""


@functools.lru_cache(maxsize=1)
def capabilities() -> Capabilities:
    """One device, the CPU: float32, float16 and bfloat16, none of them fast; every FP8
    recipe, emulated (:mod:`mixprec_numpy.fp8`)."""
    cpu = DeviceCapability("cpu", compute_dtypes=DTYPES, fast_dtypes=(), fp8_recipes=FP8_RECIPES)
    return Capabilities(backend="numpy", framework_version=np.__version__, devices=(cpu,))


def check_dtype(dtype: str, what: str) -> None:
    """Refuse a dtype the backend cannot compute in, naming the fix."""
    if dtype not in DTYPES:
        raise UnsupportedDtypeError(
            f"the NumPy backend cannot compute in {dtype} ({what}); it runs float32, float16 "
            "and bfloat16 only. Use a float16 or bfloat16 policy such as 'O2-bf16'"
        )


def resolve_policy(spec: str | Policy, device: str = "cpu") -> Policy:
    """The policy a trainer runs: ``auto`` resolved for ``device``, every dtype checked."""

    def check(policy: Policy) -> None:
        for role in ("param", "compute", "output", "master"):
            dtype = getattr(policy, role)
            if dtype is not None and not (role == "master" and policy.master_strategy):
                check_dtype(dtype, f"the policy's {role} dtype")

    # an unknown device raises BackendNotAvailable naming the ones there are
    return resolve_for_device(spec, "numpy", device, capabilities(), check=check)
