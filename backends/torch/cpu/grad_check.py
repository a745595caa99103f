"""The step guard's pass over the gradients with the native kernel (step 3 and 4's check).

:func:`mixprec_torch.step.protocol.unscale` reads every gradient the optimizer will apply: casts
the model's gradients into the float32 masters' (O2 and the generic compensated path),
unscales them (loss scaling) and checks them (:mod:`mixprec.guard`: any inf or NaN, or a
squared global norm beyond float32). With torch operations that is a cast, one fused
unscale-and-check and one norm kernel *per tensor* (``torch._foreach_norm`` runs tensor by
tensor on the CPU), plus a Python loop sorting the gradients by device and dtype. Where every
parameter is a CPU tensor and every gradient dense and contiguous, :func:`native_unscale`
does all of it in one call of the native kernel (:func:`mixprec_torch.cpu.clib.guard_pass`):
one read of each gradient, the unscaled float32 value written where a master gradient or an
in-place unscale needs it. The values written are the torch path's bit for bit (a cast, then
one float32 multiply by the inverse scale); the overflow flag is the same test, its sum taken
in a different order.

What does not change from step to step (which tensors, their sizes and dtypes) is a
:class:`GuardPlan`, built once per layout of the optimizer's parameter groups; a step reads
each gradient's address and checks its layout, nothing more.

A pass that did not unscale (O0 and the other policies without loss scaling) leaves its sum
of squares on the plan, where asked (:meth:`GuardPlan.squares_of`): no square exceeds it, so
it bounds the largest gradient, the bound the low-bit fused step needs before it overwrites
any codes (:mod:`mixprec_torch.lowbit.fused_step`), without a second read of the gradients.
"""

from __future__ import annotations

import array
import ctypes
import weakref
from collections.abc import Callable, Sequence
from itertools import accumulate

import torch

from ..torch_private import tensor_versions
from . import clib

__all__ = ["FLOAT32_MAX", "GuardPlan", "native_unscale"]

#: The largest finite float32: a larger sum of squares is an overflow (:mod:`mixprec.guard`).
FLOAT32_MAX = 3.4028234663852886e38

_CODES = clib.DTYPE_CODES
_STRIDED = torch.strided

Buffers = Callable[
    [list[torch.Tensor | None], list[torch.Tensor]], tuple[list[torch.Tensor], list[torch.Tensor]]
]


class GuardPlan:
    """The optimizer's tensors as the native pass sees them: the parameters updated with
    their own gradients (``plain``) and the separate masters with their model parameters
    (``masters``, ``models``), each with its element count and gradient dtype code.

    :param key: what the plan was built for (the cached ``copies`` lists): a new key, a new
        plan.
    """

    def __init__(
        self,
        key: object,
        optimizer: torch.optim.Optimizer,
        masters_of: dict[int, torch.Tensor],
    ) -> None:
        self.key = key
        self.plain: list[torch.Tensor] = []
        self.masters: list[torch.Tensor] = []
        self.models: list[torch.Tensor] = []
        usable = True
        for group in optimizer.param_groups:
            for param in group["params"]:
                model = masters_of.get(id(param))
                owner = param if model is None else model
                if owner.dtype not in _CODES or not owner.is_cpu:
                    usable = False
                if model is None:
                    self.plain.append(param)
                else:
                    self.masters.append(param)
                    self.models.append(model)
        self.usable = usable
        """Every parameter is a CPU tensor of a dtype the kernel reads."""
        self.plain_numel = [p.numel() for p in self.plain]
        self.plain_codes = [_CODES.get(p.dtype, -1) for p in self.plain]
        self.model_numel = [m.numel() for m in self.models]
        self.model_codes = [_CODES.get(m.dtype, -1) for m in self.models]
        self.plain_half = any(p.dtype == torch.float16 for p in self.plain)
        self._arrays: dict[tuple[bool, bool], tuple[array.array, ...]] = {}  # type: ignore[type-arg]
        self.keep_squares = False
        """Whether a pass keeps its sum as :attr:`read` (set by the first who asks: the
        low-bit fused step; a pass without it reads no version counter)."""
        self.read: tuple[float, list[weakref.ref[torch.Tensor]], list[int]] | None = None
        """The latest pass's sum of squares where it did not unscale, with the tensors it
        read (and did not write; weak references: a skipped step keeps no gradient alive)
        and their version counters then; None where the latest pass unscaled, or took the
        gradients not at all, or the sum was taken (:meth:`squares_of`)."""

    def squares_of(self, grads: list[torch.Tensor]) -> float | None:
        """The sum of squares of the latest pass that did not unscale, once, where it read each
        of ``grads`` (the same tensors) and none was written in place since (their version
        counters unchanged); None otherwise. The sum is of float32 lanes, each square added
        to its lane rounded to nearest, so no square in it is larger (to one rounding), and it
        is inf or NaN where a gradient is not finite."""
        read, self.read = self.read, None
        if read is None:
            return None
        total, refs, versions = read
        alive = [(ref(), v) for ref, v in zip(refs, versions, strict=True)]
        seen = {id(t): v for t, v in alive if t is not None}  # alive: their ids are theirs
        now = tensor_versions(grads)
        if any(seen.get(id(g)) != v for g, v in zip(grads, now, strict=True)):
            return None  # not read by that pass, or written in place since
        return total

    def arrays(
        self,
        cast: bool,
        scaled: bool,
        sources: Sequence[int] | None,
        numel: Sequence[int] | None,
    ) -> tuple[array.array, ...]:  # type: ignore[type-arg]
        """(starts, source codes, target codes): for every tensor when ``sources`` is None
        (cached), else for the tensors at ``sources`` (indices into plain, then models)."""
        full = sources is None
        cached = self._arrays.get((cast, scaled)) if full else None
        if cached is not None:
            return cached
        if sources is None or numel is None:
            sources = range(len(self.plain) + len(self.models))
            numel = [*self.plain_numel, *self.model_numel]
        codes = [*self.plain_codes, *self.model_codes]
        n_plain = len(self.plain)
        sdt = array.array("i", [codes[i] for i in sources])
        # in place (plain, scaled): the gradient's own dtype; a master's gradient: float32 (0)
        ddt = array.array("i", [codes[i] if scaled and i < n_plain else 0 for i in sources])
        starts = array.array("q", [0])
        starts.extend(accumulate(numel))
        out = (starts, sdt, ddt)
        if full:
            self._arrays[(cast, scaled)] = out
        return out


_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_DATA_PTR = torch.Tensor.data_ptr


def _all_dense(grads: list[torch.Tensor | None]) -> bool | None:
    """True: every gradient is there, dense and contiguous (checked in C, no Python loop);
    False: one is not contiguous; None: one is missing or not strided (look closer)."""
    try:
        return all(map(_IS_CONTIGUOUS, grads))  # type: ignore[arg-type]
    except (TypeError, RuntimeError):  # None, or a layout without is_contiguous (CSR)
        return None


def _ok(grad: torch.Tensor | None) -> bool:
    return grad is None or (grad.layout is _STRIDED and grad.is_contiguous())


def native_unscale(
    lib: ctypes.CDLL,
    plan: GuardPlan,
    inv_scale: float | None,
    cast: bool,
    buffers: Buffers,
) -> bool | None:
    """Unscale and check the optimizer's gradients in one native pass. Returns whether a
    gradient overflowed (False when no parameter has a gradient), a verdict on the host, or
    None when the pass cannot take them (a gradient that is sparse or not contiguous): the
    caller then takes the torch path (nothing was written).

    :param plan: the optimizer's :class:`GuardPlan` (``usable``).
    :param inv_scale: multiply by this (loss scaling), or None.
    :param cast: write the model gradients into the masters' float32 gradients; when False
        the separate masters' model gradients are only read (the fused compensated update
        reads them itself).
    :param buffers: (model gradients, masters) -> (the masters' gradient buffers, the
        dense model gradients to write into them), None gradients cleared
        (:func:`mixprec_torch.step.model_edits.grad_buffers`).
    """
    scaled = inv_scale is not None
    plan.read = None
    if scaled and plan.plain_half:
        return None  # the kernel writes float32 and bfloat16 only
    plain = [p.grad for p in plan.plain]
    models = [m.grad for m in plan.models]
    dense = _all_dense(plain + models)  # type: ignore[operator]
    if dense is False or (dense is None and not all(map(_ok, plain + models))):  # type: ignore[operator]
        return None
    n_plain = len(plain)
    if dense:  # the usual step: every tensor has its gradient
        picked = None
        present: list[torch.Tensor] = models  # type: ignore[assignment]
        src_plain: list[torch.Tensor] = plain  # type: ignore[assignment]
    else:
        picked = [i for i, g in enumerate(plain) if g is not None]
        src_plain = [plain[i] for i in picked]  # type: ignore[misc]
        at = [i for i, g in enumerate(models) if g is not None]
        picked += [n_plain + i for i in at]
        present = [models[i] for i in at]  # type: ignore[misc]
    if cast:  # only now that nothing can refuse: the masters' gradient buffers
        dst, src = buffers(models, plan.masters)
        if not all(map(_IS_CONTIGUOUS, dst)):
            return None  # the torch path copies into them whatever their layout
        present = src
    sources = src_plain + present
    if not sources:
        return False
    src_ptrs = array.array("Q", list(map(_DATA_PTR, sources)))
    # an in-place unscale writes where it reads: the plain sources' addresses again
    dst_ptrs = src_ptrs[: len(src_plain)] if scaled else array.array("Q", bytes(8 * len(src_plain)))
    dst_ptrs.extend(
        array.array("Q", list(map(_DATA_PTR, dst)))
        if cast
        else array.array("Q", bytes(8 * len(present)))
    )
    if picked is None:
        starts, sdt, ddt = plan.arrays(cast, scaled, None, None)
    else:
        numel = [[*plan.plain_numel, *plan.model_numel][i] for i in picked]
        starts, sdt, ddt = plan.arrays(cast, scaled, picked, numel)
    total = clib.guard_pass(lib, src_ptrs, dst_ptrs, starts, sdt, ddt, inv_scale)
    if plan.keep_squares and not scaled:  # the sources read (a cast writes the masters')
        plan.read = (total, [weakref.ref(t) for t in sources], tensor_versions(sources))
    return not total <= FLOAT32_MAX  # NaN (a NaN gradient) fails the comparison too
