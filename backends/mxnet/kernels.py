"""Which MXNet ops have a bfloat16 CPU kernel on this machine: probed once per process.

MXNet 1.9 computes bfloat16 on CPU through oneDNN, and oneDNN builds its bfloat16
``FullyConnected``, ``Convolution``, ``BatchNorm``, ``Pooling`` and activation primitives only
on CPUs with AVX512 (AVX512-BF16 or AMX for speed). On an AVX2-only CPU every one of them fails
with ``MXNetError: could not create a primitive descriptor iterator``, while ``relu``,
element-wise ``+`` or ``amp_cast`` still run in bfloat16. Whether a kernel exists is a fact
about the device, so it is measured, not guessed from the build: :func:`missing_bf16_cpu_ops`
runs each op once on a tiny bfloat16 array (forward and backward, well under 0.1 s for all)
and caches the answer for the process.

What the backend does with the answer:

- ``auto`` resolves to float32 when the CPU has no bfloat16 GEMM or convolution kernel
  (:func:`bf16_cpu_is_fast`): bfloat16 would only be slower there;
- an explicit bfloat16 policy runs every op without a kernel as a *float32 island*: its inputs
  are cast to float32, it computes in float32 and its outputs are cast back to bfloat16, so the
  weights (and masters) keep the policy's dtypes (:func:`warn_islands` says so once per trainer).
  This keeps the policy's numerics, not its speed: on an AVX2-only CPU ``amp_cast`` to and
  from bfloat16 runs at ~100 ns per element (a float32 copy: ~4 ns), so even with consecutive
  islands passing float32 to each other (:func:`mixprec_mxnet.islands.chained_islands`) the
  casts of weights and master copies leave an O2-bf16 CNN step there about 1.7x O0's, and a
  large MLP's 6-11x (docs/benchmarks.md, section 2 reading).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import mxnet as mx
from mxnet import autograd, nd

from mixprec.errors import MixprecWarning

from .dtypes import BFLOAT16_NP

__all__ = [
    "GEMM_OPS",
    "ISLAND_WARNING_PREFIX",
    "PROBED_OPS",
    "Bf16IslandWarning",
    "bf16_cpu_is_fast",
    "island_warning_text",
    "missing_bf16_cpu_ops",
    "warn_islands",
]


def _b(*shape: int) -> nd.NDArray:
    return nd.amp_cast(nd.ones(shape), dtype=BFLOAT16_NP)


def _fully_connected(x: nd.NDArray) -> nd.NDArray:
    return nd.FullyConnected(x.reshape((2, 8)), _b(4, 8), no_bias=True, num_hidden=4)


def _convolution(x: nd.NDArray) -> nd.NDArray:
    return nd.Convolution(x, _b(2, 2, 3, 3), no_bias=True, kernel=(3, 3), num_filter=2)


def _deconvolution(x: nd.NDArray) -> nd.NDArray:
    return nd.Deconvolution(x, _b(2, 2, 3, 3), no_bias=True, kernel=(3, 3), num_filter=2)


def _batch_norm(x: nd.NDArray) -> nd.NDArray:
    ones, zeros = nd.ones((2,)), nd.zeros((2,))  # MXNet's BatchNorm keeps these in float32
    return nd.BatchNorm(x, ones, zeros, zeros.copy(), ones.copy())


#: Native op -> a tiny call of it on a (1, 2, 4, 4) bfloat16 input. The ops whose bfloat16 CPU
#: kernels come from oneDNN's AVX512 code paths; the ops known to lack a bfloat16 kernel on
#: every CPU are listed in :data:`mixprec_mxnet.ops.NO_BF16_ON_CPU` instead.
PROBED_OPS: dict[str, Callable[[nd.NDArray], nd.NDArray]] = {
    "FullyConnected": _fully_connected,
    "Convolution": _convolution,
    "Deconvolution": _deconvolution,
    "BatchNorm": _batch_norm,
    "Pooling": lambda x: nd.Pooling(x, kernel=(2, 2), pool_type="max"),
    "Activation": lambda x: nd.Activation(x, act_type="relu"),
    "LeakyReLU": lambda x: nd.LeakyReLU(x, act_type="leaky"),
}

#: The ops whose kernels decide whether bfloat16 pays off on the CPU (``auto``).
GEMM_OPS = ("FullyConnected", "Convolution")


def _runs(fn: Callable[[nd.NDArray], nd.NDArray]) -> bool:
    x = _b(1, 2, 4, 4)
    x.attach_grad()
    try:
        with autograd.record():
            y = fn(x)
        y.wait_to_read()
        y.backward()
        x.grad.wait_to_read()
    except mx.MXNetError:
        # the failed op also left the error in the engine, which would raise it again at the
        # next waitall() or at interpreter exit: collect it here
        with contextlib.suppress(mx.MXNetError):
            nd.waitall()
        return False
    return True


@functools.cache
def missing_bf16_cpu_ops() -> frozenset[str]:
    """The native ops of :data:`PROBED_OPS` that have no bfloat16 CPU kernel here (cached).

    Empty on CPUs with AVX512-BF16; on AVX2-only CPUs, all of them. An MXNet build without
    oneDNN has no bfloat16 on CPU at all and is refused earlier (see :mod:`.devices`).
    """
    return frozenset(name for name, fn in PROBED_OPS.items() if not _runs(fn))


def bf16_cpu_is_fast() -> bool:
    """Whether the CPU runs bfloat16 matrix products and convolutions natively."""
    return not (set(GEMM_OPS) & missing_bf16_cpu_ops())


#: How the island warning starts (for ``-W ignore:...`` filters, which match a prefix).
ISLAND_WARNING_PREFIX = "no bfloat16 kernel on this CPU"


class Bf16IslandWarning(MixprecWarning):
    """Some ops of a bfloat16 policy run as float32 islands: the CPU has no bfloat16 kernel."""


def island_warning_text(policy_label: str, ops: Iterable[str]) -> str:
    """The warning's text: which ops, why, and what it means for the numerics."""
    names = ", ".join(sorted(ops))
    return (
        f"{ISLAND_WARNING_PREFIX} for {names} (it lacks AVX512-BF16, which MXNet "
        f"{mx.__version__}'s oneDNN needs for them): under policy {policy_label} these ops run "
        "as float32 islands (inputs cast to float32, float32 compute, outputs cast back to "
        "bfloat16). Weights, masters and every other op keep the policy's dtypes, but bfloat16 "
        "is slower than float32 on this CPU: policy='auto' picks float32 here"
    )


def warn_islands(policy_label: str, ops: Any, stacklevel: int = 3) -> None:
    """Warn once that ``ops`` run as float32 islands under ``policy_label``."""
    if ops:
        warnings.warn(
            island_warning_text(policy_label, ops), Bf16IslandWarning, stacklevel=stacklevel + 1
        )
