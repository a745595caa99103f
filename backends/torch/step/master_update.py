"""How O2's float32 masters are updated: torch's fused Adam/AdamW kernel where the user left
the choice of implementation to torch.

Under ``master=float32`` (O2, O2-bf16) the optimizer updates float32 masters that mixprec
created; the user never had an optimizer over them. On the CPU torch picks its per-tensor
for-loop implementation unless told otherwise (its default prefers the foreach and fused
kernels on GPUs only), and for a model of large tensors that for-loop is most of the step:
AdamW over 16.8 M float32 parameters makes about ten sweeps over memory, where the fused
kernel (``fused=True``) makes one. So ``wrap`` sets ``fused=True`` on each parameter group of
a ``torch.optim.Adam`` or ``AdamW`` whose ``fused`` and ``foreach`` are both None (torch's
"choose for me"), whose parameters are all floating tensors on devices torch's fused kernels
support, and that is not ``differentiable``. An optimizer constructed with ``fused=False``
or ``foreach=...`` keeps the implementation asked for. The fused kernel computes the same
update as the for-loop one, rounded differently in the last bit of some elements.
"""

from __future__ import annotations

import torch

from .optimizer_state import base_class

__all__ = ["prefer_fused_kernel"]

_FUSED_CLASSES = (torch.optim.Adam, torch.optim.AdamW)
_FUSED_DEVICES = ("cpu", "cuda")


def _fusable_group(group: dict[str, object]) -> bool:
    params = group["params"]
    assert isinstance(params, list)
    return (
        group.get("fused") is None
        and group.get("foreach") is None
        and not group.get("differentiable", False)
        and isinstance(group.get("lr"), float)
        and all(isinstance(b, float) for b in group.get("betas", ()))  # type: ignore[attr-defined]
        and all(
            isinstance(p, torch.Tensor)
            and p.is_floating_point()
            and p.device.type in _FUSED_DEVICES
            and not p.is_complex()
            for p in params
        )
    )


def prefer_fused_kernel(optimizer: torch.optim.Optimizer) -> bool:
    """Switch ``optimizer``'s eligible parameter groups (see the module) to torch's fused
    kernel; whether any was switched."""
    if base_class(optimizer) not in _FUSED_CLASSES:
        return False
    switched = False
    for group in optimizer.param_groups:
        if _fusable_group(group):
            group["fused"] = True
            switched = True
    return switched
