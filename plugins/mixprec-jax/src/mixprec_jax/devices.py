"""What each JAX device computes in, the ops the plugin cannot see, and the policy checks.

Named ``devices`` like the other backends' module: a submodule called ``capabilities``
would replace the package's ``capabilities()`` function once imported.

XLA compiles float16 and bfloat16 for every device, but on the CPU it runs their matrix
products and convolutions through float32 kernels (docs/benchmarks.md measures it), so
neither is *fast* there and ``auto`` resolves to float32. On CUDA GPUs bfloat16 is fast
from compute capability 8.0 and float16 from 7.0; TPUs run bfloat16 natively and have no
float16 matrix unit.
"""

from __future__ import annotations

import functools

import jax

from mixprec.errors import UnsupportedDtypeError
from mixprec.kit import (
    BFLOAT16,
    FLOAT16,
    FLOAT32,
    Capabilities,
    DeviceCapability,
    Policy,
    UnseenOp,
    check_rules_visible,
    check_traceable,
    parse_state_format,
    resolve_for_device,
)

__all__ = [
    "UNSEEN_OPS",
    "capabilities",
    "check_dtype",
    "check_dtypes",
    "device_name",
    "resolve_policy",
]

_OPERATORS = "Python operators (x + y) and array methods reach no function a plugin can wrap"
_NO_SUCH_OP = "JAX and optax have no such function"

UNSEEN_OPS: tuple[UnseenOp, ...] = (
    *(UnseenOp(op, "promote", _OPERATORS) for op in ("add", "sub", "mul", "div")),
    *(
        UnseenOp(op, "absent", _NO_SUCH_OP)
        for op in ("addcmul", "addcdiv", "nll_loss", "l1_loss", "binary_cross_entropy")
    ),
)
"""Op families whose rules the plugin cannot apply. JAX's type promotion computes mixed
floating inputs in the widest of them, which is the ``promote`` rule; the ``absent``
families are written out in other ops in JAX code, which follow their own rules."""


def device_name(device: jax.Device) -> str:
    """A device as ``capabilities()`` names it: ``"cpu:0"``, ``"gpu:1"``, ``"tpu:0"``."""
    return f"{device.platform}:{device.id}"


def _describe(device: jax.Device) -> DeviceCapability:
    name = device_name(device)
    if device.platform == "gpu":
        major, _, minor = str(getattr(device, "compute_capability", "0.0")).partition(".")
        cc = (int(major or 0), int(minor or 0))
        lowp = ((BFLOAT16,) if cc >= (8, 0) else ()) + (FLOAT16,)
        fast = tuple(d for d in lowp if cc >= ((8, 0) if d == BFLOAT16 else (7, 0)))
        return DeviceCapability(name, (FLOAT32, *lowp), fast)
    if device.platform == "tpu":
        return DeviceCapability(name, (FLOAT32, BFLOAT16), (BFLOAT16,))
    # the CPU (and anything else): XLA compiles both, through float32 kernels
    return DeviceCapability(name, (FLOAT32, BFLOAT16, FLOAT16), ())


@functools.lru_cache(maxsize=1)
def capabilities() -> Capabilities:
    """Every device JAX sees, with the op families the plugin cannot see.

    Example::

        import mixprec.jax as mpj

        caps = mpj.capabilities()
        cpu = caps.device("cpu:0")
        assert "bfloat16" in cpu.compute_dtypes  # XLA compiles it on a CPU...
        assert cpu.fast_dtypes == ()  # ...through float32 kernels: 'auto' picks float32
        assert caps.unseen("add") is not None  # x + y reaches no function to wrap
    """
    return Capabilities(
        backend="jax",
        framework_version=jax.__version__,
        devices=tuple(_describe(d) for d in jax.devices()),
        unseen_ops=UNSEEN_OPS,
    )


def check_dtype(dtype: str, device: str, what: str) -> None:
    """Refuse a dtype ``device`` cannot compute in, naming the fix."""
    cap = capabilities().device(device)
    if dtype not in cap.compute_dtypes:
        fix = "'O2-bf16'" if BFLOAT16 in cap.compute_dtypes else "'O0' (float32)"
        raise UnsupportedDtypeError(
            f"the JAX backend's device {cap.device} cannot compute in {dtype} ({what}); it "
            f"runs {', '.join(cap.compute_dtypes)}. Use a policy in those dtypes, such as {fix}"
        )


def check_dtypes(policy: Policy, device: str) -> None:
    """Refuse a policy whose dtypes ``device`` cannot compute in, naming the fix."""
    for role in ("param", "compute", "output", "reduce", "master"):
        dtype = getattr(policy, role)
        if role == "master" and (dtype is None or policy.master_strategy):
            continue
        check_dtype(dtype, device, f"the policy's {role} dtype")


def resolve_policy(spec: str | Policy, device: str = "cpu") -> Policy:
    """The policy an optimizer runs: ``auto`` resolved for ``device``, then every check
    that must pass before anything is traced (dtypes the device runs, rules the plugin can
    apply, a loss scale a compiled step can follow)."""

    def check(policy: Policy) -> None:
        check_dtypes(policy, device)
        check_traceable(policy.loss_scale, "jax")
        check_rules_visible(policy, capabilities())
        if policy.state is not None and parse_state_format(policy.state) is None:
            raise UnsupportedDtypeError(
                f"the JAX backend keeps the optimizer state as optax allocates it or in 8 or "
                f"4 bits (state=int8, int4, fp8); state={policy.state} is not supported. Drop "
                f"state from {policy.label}, or keep it quantized (state=int8)"
            )

    return resolve_for_device(spec, "jax", device, capabilities(), check=check)
