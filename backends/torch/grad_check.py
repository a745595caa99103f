"""The step guard's pass over the gradients with the native kernel (step 3 and 4's check).

:func:`mixprec_torch.stepping.unscale` reads every gradient the optimizer will apply: casts
the model's gradients into the float32 masters' (O2 and the generic compensated path),
unscales them (loss scaling) and checks them (:mod:`mixprec.guard`: any inf or NaN, or a
squared global norm beyond float32). With torch operations that is a cast, one fused
unscale-and-check and one norm kernel *per tensor* (``torch._foreach_norm`` runs tensor by
tensor on the CPU), plus a Python loop sorting the gradients by device and dtype. Where every
gradient is a dense contiguous CPU tensor, :func:`native_unscale` does all of it in one call
of the native kernel (:func:`mixprec_torch.native.guard_pass`): one read of each gradient,
the unscaled float32 value written where a master gradient or an in-place unscale needs it.
The values written are the torch path's bit for bit (a cast, then one float32 multiply by the
inverse scale); the overflow flag is the same test, its sum taken in a different order.
"""

from __future__ import annotations

import array
import ctypes
from collections.abc import Callable
from itertools import accumulate

import torch

from . import native

__all__ = ["FLOAT32_MAX", "native_unscale"]

#: The largest finite float32: a larger sum of squares is an overflow (:mod:`mixprec.guard`).
FLOAT32_MAX = 3.4028234663852886e38

_CODES = native.DTYPE_CODES


def _dense_cpu(t: torch.Tensor) -> bool:
    return (
        t.dtype in _CODES
        and t.layout == torch.strided
        and t.device.type == "cpu"
        and t.is_contiguous()
    )


Buffers = Callable[
    [list[torch.Tensor | None], list[torch.Tensor]], tuple[list[torch.Tensor], list[torch.Tensor]]
]


def native_unscale(
    lib: ctypes.CDLL,
    optimizer: torch.optim.Optimizer,
    masters_of: dict[int, torch.Tensor],
    inv_scale: float | None,
    cast: bool,
    buffers: Buffers,
) -> list[torch.Tensor] | None:
    """Unscale and check the optimizer's gradients in one native pass. Returns the overflow
    flags (one float32 CPU tensor, nonzero on overflow; none when no parameter has a
    gradient), or None when a gradient is not a dense contiguous CPU tensor: the caller
    then takes the torch path (nothing was written).

    :param masters_of: id(master) -> its model parameter, for the separate masters.
    :param inv_scale: multiply by this (loss scaling), or None.
    :param cast: write the model gradients into the masters' float32 gradients; when False
        the separate masters' model gradients are only read (the fused compensated update
        reads them itself).
    :param buffers: (model gradients, masters) -> (the masters' gradient buffers, the
        dense model gradients to write into them), None gradients cleared
        (:func:`mixprec_torch.model_edits.grad_buffers`).
    """
    sources: list[torch.Tensor] = []
    targets: list[torch.Tensor | None] = []
    model_grads: list[torch.Tensor | None] = []
    into: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            model = masters_of.get(id(param))
            if model is None:  # the optimizer's own tensor: its gradient, in place
                grad = param.grad
                if grad is None:
                    continue
                if not _dense_cpu(grad) or (inv_scale is not None and grad.dtype == torch.float16):
                    return None  # (the kernel writes float32 and bfloat16 only)
                sources.append(grad)
                targets.append(grad if inv_scale is not None else None)
                continue
            grad = model.grad
            if grad is not None and not _dense_cpu(grad):
                return None
            if cast:
                model_grads.append(grad)
                into.append(param)
            elif grad is not None:
                sources.append(grad)
                targets.append(None)
    if cast and into:  # only now that nothing can refuse: the masters' gradient buffers
        dst, src = buffers(model_grads, into)
        if not all(t.is_contiguous() and t.dtype == torch.float32 for t in dst):
            return None  # the torch path copies into them whatever their layout
        sources.extend(src)
        targets.extend(dst)
    if not sources:
        return []
    starts = array.array("q", [0])
    starts.extend(accumulate(t.numel() for t in sources))
    total = native.guard_pass(lib, sources, targets, starts, inv_scale)
    overflow = not total <= FLOAT32_MAX  # NaN (a NaN gradient) fails the comparison too
    return [torch.full((1,), float(overflow))]
