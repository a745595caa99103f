"""Counter-based noise for stochastic rounding (``master=stochastic``, ``state="bfloat16"``).

Rounding a float32 value ``x`` stochastically onto the bfloat16 grid adds 16 uniform random
bits to its bit pattern and clears the low 16 (:mod:`mixprec.compensated`). The bits are a
function of where they are used, not a stream that is drawn:

- a *pass* (the weights of one step, one state slot of one step) has a 64-bit key derived
  from the wrap call's ``seed``, the step's number on that device (:class:`Stream`, its
  ``draws``) and the slot (:func:`pass_key`);
- element ``i`` of the pass (its position in the device's flat layout) gets bits
  ``16 * (i % 4)`` to ``16 * (i % 4) + 15`` of splitmix64's output for the counter
  ``key + (i // 4) * 0x9E3779B97F4A7C15``.

So the noise does not depend on how the work is split (slices, threads, fused or not), and a
checkpoint needs only the seed and the step counts to resume the same numbers. The native
kernels (:mod:`mixprec_torch.cpu.clib`) compute it inside their passes on the CPU; the twin
here computes the same numbers with element-wise int64 torch operations on the tensor's own
device (torch has no uint64: the 64-bit arithmetic wraps around in int64 and the logical
shifts are arithmetic shifts masked), so a CUDA tensor's noise is drawn on the GPU and the C
library is never asked for (tests/torch/test_cpu_kernels.py checks that they agree bit for
bit).
"""

from __future__ import annotations

import torch

from . import clib

__all__ = ["SLICE", "Stream", "flat_slices", "noise", "pass_key", "round_stochastic_"]

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_HIGH_MASK = -(1 << 16)  # 0xFFFF0000 as an int32

SLICE = 1 << 20
"""Elements per slice of a flat pass that needs temporaries (the noise, a mixed-dtype op):
they stay at 4 MiB, which the allocator reuses from step to step; one model-sized temporary
would be fresh pages every step."""


def flat_slices(numel: int) -> list[slice]:
    """Slices of :data:`SLICE` elements covering a flat buffer of ``numel``."""
    return [slice(start, start + SLICE) for start in range(0, numel, SLICE)]


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def pass_key(seed: int, draws: int, slot: int) -> int:
    """The key of one pass: ``slot`` 0 is the weights, ``1 + k`` the optimizer state's k-th
    slot (Adam's ``exp_avg``, ``exp_avg_sq``; the whole state under the generic path)."""
    z = _mix((seed + _GAMMA) & _MASK64)
    z = _mix((z + draws * _GAMMA) & _MASK64)
    return _mix((z + (slot + 1) * _GAMMA) & _MASK64)


class Stream:
    """The noise of one device: the seed and how many steps have drawn from it."""

    __slots__ = ("draws", "seed")

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.draws = 0

    def key(self, slot: int) -> int:
        """This step's key for ``slot`` (see :func:`pass_key`)."""
        return pass_key(self.seed, self.draws, slot)


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values seen as unsigned."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _noise_torch(
    key: int, index: int, count: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The twin of the C's noise, computed on ``device``."""
    first = index >> 2
    blocks = torch.arange(first, ((index + count + 3) >> 2), dtype=torch.int64, device=device)
    z = blocks.mul_(_signed(_GAMMA)).add_(_signed(key))
    z = (z ^ _shr(z, 30)).mul_(_signed(_M1))
    z = (z ^ _shr(z, 27)).mul_(_signed(_M2))
    z = z ^ _shr(z, 31)
    lanes = torch.stack([(z >> shift) & 0xFFFF for shift in (0, 16, 32, 48)], dim=1).view(-1)
    skip = index - (first << 2)
    return lanes.narrow(0, skip, count).to(torch.int32)


def noise(key: int, index: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16-bit noise (as int32 values in ``[0, 2**16)``) of elements ``index`` to
    ``index + count - 1`` of a pass with ``key``, on ``device``."""
    if torch.device(device).type == "cpu":
        lib = clib.library()
        if lib is not None:
            return clib.noise(lib, key, index, count)
    return _noise_torch(key, index, count, device)


def round_stochastic_(work: torch.Tensor, key: int, index: int = 0) -> None:
    """Round the contiguous float32 ``work`` (in its flat order) stochastically onto the
    bfloat16 grid, in place: add the pass's noise to the bit patterns and clear their low 16
    bits, so a later copy into bfloat16 is exact. Unbiased: of the two bfloat16 neighbours
    the farther one (in magnitude) is chosen with probability equal to the distance from the
    nearer one in units of their spacing. ``index`` is the position of ``work[0]`` in the
    pass."""
    if work.device.type == "cpu" and work.is_contiguous():
        lib = clib.library()
        if lib is not None:
            clib.round_stochastic(lib, work, key, index)
            return
    flat = work.view(-1)
    total = flat.numel()
    for start in range(0, total, SLICE):
        bits = flat.narrow(0, start, min(SLICE, total - start)).view(torch.int32)
        drawn = _noise_torch(key, index + start, bits.numel(), work.device)
        bits.add_(drawn).bitwise_and_(_HIGH_MASK)
