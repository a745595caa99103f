"""Which MXNet ops have a bfloat16 CPU kernel on this machine: probed once per process.

MXNet 1.9 computes bfloat16 on CPU through oneDNN, and oneDNN builds its bfloat16
``FullyConnected``, ``Convolution``, ``BatchNorm``, ``Pooling`` and activation primitives only
on CPUs with AVX512. On an AVX2-only CPU every one of them fails with
``MXNetError: could not create a primitive descriptor iterator``, while ``relu``, element-wise
``+`` or ``amp_cast`` still run in bfloat16. Whether a kernel exists is a fact about the
device, so it is measured, not guessed from the build: :func:`missing_bf16_cpu_ops` runs each
op once on a tiny bfloat16 array (forward and backward, well under 0.1 s for all) and caches
the answer for the process.

A kernel that exists is not always fast: on an AVX512 CPU without the bfloat16 dot-product
instructions (AVX512-BF16, or AMX) oneDNN emulates them, and a bfloat16 ``FullyConnected``
is about 2.5x *slower* than float32 (measured with ``DNNL_MAX_CPU_ISA=AVX512_CORE`` on a Zen 4:
36 ms against 14 ms for 256x1024x1024; natively 6.7 ms against 9.0 ms). So
:func:`bf16_cpu_is_fast` also asks the CPU for those instructions
(:func:`cpu_has_bf16_instructions`).

What the backend does with the answer:

- ``auto`` resolves to float32 unless the CPU runs bfloat16 GEMM and convolution natively
  (:func:`bf16_cpu_is_fast`): bfloat16 would only be slower there;
- an explicit bfloat16 policy runs every op without a kernel as a *float32 island*: its inputs
  are cast to float32, it computes in float32 and its outputs are cast back to bfloat16, so the
  weights (and masters) keep the policy's dtypes (:func:`warn_islands` says so once per trainer).
  This keeps the policy's numerics, not its speed. On an AVX2-only CPU MXNet's ``amp_cast`` to
  and from bfloat16 runs at ~100 ns per element (a float32 copy: ~4 ns), so mixprec converts
  with float32 ops where it can (:mod:`mixprec_mxnet.bf16_rounding`: ``amp_cast``'s bits at a
  tenth of its cost): O1's rounding of every island's inputs and outputs, the islands' casts
  of bfloat16 weights and of their outputs, the step's master copies of large arrays. The
  islands' casts of bfloat16 activations keep ``amp_cast`` (the graph does not say their
  dtype where the cast is built). On model_zoo's resnet18_v1 (batch 16 of 3x32x32) an
  O1-bf16 step there is then 2.25x O0's (18.3x with ``amp_cast``), O2-bf16 9.6x (16.3x)
  (``benchmarks/gluon_bf16_casts.py``; docs/benchmarks.md, section 2 reading).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import mxnet as mx
from mxnet import autograd, nd

from mixprec.errors import MixprecWarning
from mixprec.kit import BFLOAT16, user_stacklevel

from .dtypes import BFLOAT16_NP

__all__ = [
    "GEMM_OPS",
    "ISLAND_WARNING_PREFIX",
    "PROBED_OPS",
    "SLOW_WARNING_PREFIX",
    "Bf16IslandWarning",
    "bf16_cpu_is_fast",
    "cpu_has_bf16_instructions",
    "island_warning_text",
    "missing_bf16_cpu_ops",
    "slow_bf16_warning_text",
    "warn_islands",
]


def _b(*shape: int) -> nd.NDArray:
    return nd.amp_cast(nd.ones(shape), dtype=BFLOAT16_NP)


def _fully_connected(x: nd.NDArray) -> nd.NDArray:
    # the (1, 2, 4, 4) input flattened to its 32 elements, as Dense(flatten=True) reads it
    return nd.FullyConnected(x, _b(4, 32), no_bias=True, num_hidden=4, flatten=True)


def _convolution(x: nd.NDArray) -> nd.NDArray:
    return nd.Convolution(x, _b(2, 2, 3, 3), no_bias=True, kernel=(3, 3), num_filter=2)


def _deconvolution(x: nd.NDArray) -> nd.NDArray:
    return nd.Deconvolution(x, _b(2, 2, 3, 3), no_bias=True, kernel=(3, 3), num_filter=2)


def _batch_norm(x: nd.NDArray, op: Any = nd.BatchNorm) -> nd.NDArray:
    ones, zeros = nd.ones((2,)), nd.zeros((2,))  # MXNet's BatchNorm keeps these in float32
    return op(x, ones, zeros, zeros.copy(), ones.copy())  # type: ignore[no-any-return]


#: Native op -> a tiny call of it on a (1, 2, 4, 4) bfloat16 input. The ops whose bfloat16 CPU
#: kernels come from oneDNN's AVX512 code paths; the ops known to lack a bfloat16 kernel on
#: every CPU are listed in :data:`mixprec_mxnet.ops.NO_BF16_ON_CPU` instead.
PROBED_OPS: dict[str, Callable[[nd.NDArray], nd.NDArray]] = {
    "FullyConnected": _fully_connected,
    "Convolution": _convolution,
    "Deconvolution": _deconvolution,
    "BatchNorm": _batch_norm,
    # gluon.nn.BatchNormReLU's op, in graphs that models exported with it hold
    "_contrib_BatchNormWithReLU": lambda x: _batch_norm(x, nd.contrib.BatchNormWithReLU),
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


#: A line of MXNet's own C++ log (dmlc's ``LOG``): ``[05:29:05] ../src/...cc:71: ...``.
_NATIVE_LOG_LINE = re.compile(rb"^\[\d\d:\d\d:\d\d\] \S+\.(cc|cpp|h|hpp):\d+: ")


@contextlib.contextmanager
def quiet_native_log() -> Iterator[None]:
    """Inside, MXNet's C++ log lines are dropped; anything else written to stderr is kept.

    A oneDNN primitive that does not exist on this CPU (the probes below, a bfloat16 op
    run as a float32 island) makes MXNet ``LOG(ERROR)`` "could not create a primitive
    descriptor iterator" from C++, straight to file descriptor 2, where no Python setting
    reaches it and no environment variable of MXNet 1.9 silences it. So fd 2 goes to a
    temporary file inside, and what it caught is written back without those lines.
    """
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no real stderr (a notebook): nothing to do
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    try:
        with tempfile.TemporaryFile() as caught:
            os.dup2(caught.fileno(), fd)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, fd)
                caught.seek(0)
                kept = [
                    line for line in caught.read().splitlines(keepends=True)
                    if not _NATIVE_LOG_LINE.match(line)
                ]  # fmt: skip
                if kept:
                    os.write(fd, b"".join(kept))
    finally:
        os.close(saved)


@functools.cache
def missing_bf16_cpu_ops() -> frozenset[str]:
    """The native ops of :data:`PROBED_OPS` that have no bfloat16 CPU kernel here (cached).

    Empty on CPUs with AVX512-BF16; on AVX2-only CPUs, all of them. An MXNet build without
    oneDNN has no bfloat16 on CPU at all and is refused earlier (see :mod:`.devices`). The
    probes' failures are expected: MXNet's log lines about them are dropped.
    """
    with quiet_native_log():
        return frozenset(name for name, fn in PROBED_OPS.items() if not _runs(fn))


#: The CPU flags (``/proc/cpuinfo``) of the instructions oneDNN's fast bfloat16 kernels use.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")

#: ``DNNL_MAX_CPU_ISA`` values (oneDNN's names) that still allow those instructions.
_BF16_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "ALL")


def _cpu_flags() -> frozenset[str] | None:
    """The feature flags of ``/proc/cpuinfo``; None where there is none (not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        return None
    return frozenset()


def cpu_has_bf16_instructions() -> bool | None:
    """Whether oneDNN may use bfloat16 dot-product instructions here: the CPU has
    AVX512-BF16 or AMX-BF16 and ``DNNL_MAX_CPU_ISA`` (``MKLDNN_MAX_CPU_ISA``) does not cap
    oneDNN below them. None where the CPU's flags cannot be read (not Linux)."""
    for name in ("DNNL_MAX_CPU_ISA", "MKLDNN_MAX_CPU_ISA"):
        cap = os.environ.get(name, "").strip().upper()
        if cap and cap not in _BF16_ISAS:
            return False
    flags = _cpu_flags()
    if flags is None:
        return None
    return any(flag in flags for flag in BF16_CPU_FLAGS)


@functools.cache
def bf16_cpu_is_fast() -> bool:
    """Whether the CPU runs bfloat16 matrix products and convolutions natively: the probe
    found their kernels, and the CPU has the instructions that make them faster than float32
    (AVX512-BF16 or AMX; where its flags cannot be read, the kernels' presence decides)."""
    if set(GEMM_OPS) & missing_bf16_cpu_ops():
        return False
    return cpu_has_bf16_instructions() is not False


#: How the island warning starts (for ``-W ignore:...`` filters, which match a prefix).
ISLAND_WARNING_PREFIX = "no bfloat16 kernel on this CPU"

#: How the warning about emulated (slow) bfloat16 kernels starts.
SLOW_WARNING_PREFIX = "bfloat16 is emulated on this CPU"


class Bf16IslandWarning(MixprecWarning):
    """A bfloat16 policy cannot be fast on this CPU: some ops run as float32 islands (no
    bfloat16 kernel), or oneDNN emulates the bfloat16 dot products (no AVX512-BF16/AMX)."""


def island_warning_text(policy_label: str, ops: Iterable[str]) -> str:
    """The warning's text: which ops, why, and what it means for the numerics."""
    names = ", ".join(sorted(ops))
    return (
        f"{ISLAND_WARNING_PREFIX} for {names} (MXNet {mx.__version__}'s oneDNN builds them "
        "only on CPUs with AVX512, and they are fast only with AVX512-BF16 or AMX): under "
        f"policy {policy_label} these ops run as float32 islands (inputs cast to float32, "
        "float32 compute, outputs cast back to bfloat16). Weights, masters and every other op "
        "keep the policy's dtypes, so the numerics are the policy's, but the casts cost time: "
        "policy='auto' picks float32 on this CPU, and a CPU with AVX512-BF16 (or AMX) runs "
        "these ops in bfloat16"
    )


def slow_bf16_warning_text(policy_label: str) -> str:
    """The warning's text where every kernel exists but bfloat16 is emulated (slow)."""
    return (
        f"{SLOW_WARNING_PREFIX}: MXNet {mx.__version__}'s oneDNN has bfloat16 kernels here but "
        "emulates the bfloat16 dot products (the CPU lacks AVX512-BF16 and AMX, or "
        "DNNL_MAX_CPU_ISA caps oneDNN below them), so bfloat16 GEMMs and convolutions run "
        f"slower than float32. Policy {policy_label} keeps its numerics but not its speed: "
        "policy='auto' picks float32 on this CPU"
    )


def warn_islands(policy_label: str, compute: str, device: str) -> None:
    """Warn once when a ``compute`` policy cannot be fast on ``device``: its ops without a
    bfloat16 kernel run as float32 islands, or every bfloat16 kernel is emulated. The warning
    points at the user's line (the ``Trainer(...)`` or ``init_trainer`` call)."""
    if compute != BFLOAT16 or device != "cpu":
        return
    ops = missing_bf16_cpu_ops()
    if ops:
        text = island_warning_text(policy_label, ops)
    elif not bf16_cpu_is_fast():
        text = slow_bf16_warning_text(policy_label)
    else:
        return
    warnings.warn(text, Bf16IslandWarning, stacklevel=user_stacklevel())
