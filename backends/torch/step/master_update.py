"""How the optimizer's update runs where the user left the choice of implementation to torch:
torch's fused Adam/AdamW kernel for O2's float32 masters, its foreach SGD on the CPU.

**Fused Adam/AdamW for mixprec's masters.** Under ``master=float32`` (O2, O2-bf16) the
optimizer updates float32 masters that mixprec created; the user never had an optimizer over
them. On the CPU torch picks its per-tensor for-loop implementation unless told otherwise
(its default prefers the foreach and fused kernels on GPUs only), and for a model of large
tensors that for-loop is most of the step: AdamW over 16.8 M float32 parameters makes about
ten sweeps over memory, where the fused kernel (``fused=True``) makes one. So ``wrap`` sets
``fused=True`` on each parameter group of a ``torch.optim.Adam`` or ``AdamW`` whose ``fused``
and ``foreach`` are both None (torch's "choose for me"), whose parameters are all floating
tensors on devices torch's fused kernels support, and that is not ``differentiable``. An
optimizer constructed with ``fused=False`` or ``foreach=...`` keeps the implementation asked
for. The fused kernel computes the same update as the for-loop one, rounded differently in
the last bit of some elements.

**Foreach SGD on the CPU, the same bits.** For a model of many small tensors the for-loop
``torch.optim.SGD`` is mostly Python: three or four tensor calls per parameter, each paying
the interpreter and the dispatcher (300 tensors: about 3.5 ms a step, where the arithmetic is
a fraction of it). Its foreach implementation makes one call per operation for all of them.
On the CPU torch has no foreach kernels: each ``torch._foreach_*`` op runs the same per-tensor
op as the for-loop (``mul_``, ``add_`` with ``alpha``, ``neg``, ``clone``) in C++, so the
update is the for-loop's bit for bit, momentum buffers included, where the scalars are the
tensors' own dtype: float32 and float64 (in bfloat16 and float16 the foreach ops round the
momentum to the tensor's dtype first, the for-loop does not; torch's fused CPU SGD
reassociates the momentum in the elements past the last full vector, so neither is used).
So each ``step()`` runs a ``torch.optim.SGD`` (the class itself, not a subclass) whose
parameters are all float32 or float64 CPU tensors with ``foreach=True`` on every group
that:

- left ``foreach`` and ``fused`` at None and is not ``differentiable``;
- holds its ``lr``, ``momentum``, ``dampening`` and ``weight_decay`` as numbers, not tensors;
- is not Nesterov without weight decay or ``maximize`` (the foreach path would add the
  momentum into the gradients themselves; the for-loop leaves them as they were);
- where weight decay or ``maximize`` makes the foreach path copy every gradient at once
  (the for-loop holds one copy at a time), has at most :data:`COPY_LIMIT` elements;

and only when the guard's check found every gradient dense (the for-loop, given a sparse
one it cannot add weight decay to, updates the tensors before it and then raises; the
foreach path raises first). The group's ``foreach`` is None again when the step returns, so
``param_groups`` and ``state_dict()`` are the user's; only a step hook that reads
``foreach`` sees True. Never inside a compiled step (the traced code stays the user's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .optimizer_state import base_class

__all__ = ["COPY_LIMIT", "foreach_groups", "foreach_sgd_elements", "prefer_fused_kernel"]

_FUSED_CLASSES = (torch.optim.Adam, torch.optim.AdamW)
_FUSED_DEVICES = ("cpu", "cuda")
_FOREACH_TYPES = (torch.Tensor, torch.nn.Parameter)  # torch's own list: not subclasses
_FOREACH_DTYPES = (torch.float32, torch.float64)
_HYPER = ("lr", "momentum", "dampening", "weight_decay")

COPY_LIMIT = 1 << 22
"""The most elements (16 MiB of float32) whose gradients the foreach SGD may copy at once
(weight decay, ``maximize``): beyond that the copy costs memory the for-loop never held,
and the per-tensor calls it saves are a small part of the step."""


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


def foreach_sgd_elements(optimizer: torch.optim.Optimizer) -> int:
    """How many elements the optimizer's parameters hold when it is a ``torch.optim.SGD``
    whose parameters are all float32 or float64 CPU tensors (see the module); 0 otherwise.
    Decided once per layout of the parameter groups."""
    if base_class(optimizer) is not torch.optim.SGD:
        return 0
    total = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            if (
                type(param) not in _FOREACH_TYPES
                or param.dtype not in _FOREACH_DTYPES
                or not param.is_cpu
            ):
                return 0
            total += param.numel()
    return total


def _foreach_group(group: dict[str, Any], elements: int) -> bool:
    if (
        group.get("foreach") is not None
        or group.get("fused") is not None
        or group.get("differentiable", False)
        or any(isinstance(group.get(name), torch.Tensor) for name in _HYPER)
    ):
        return False
    if group.get("weight_decay", 0) != 0 or group.get("maximize", False):
        return elements <= COPY_LIMIT  # the foreach path copies the gradients first
    return not group.get("nesterov", False)  # else it would add into the gradients


def foreach_groups(optimizer: torch.optim.Optimizer, elements: int, step: Callable[[], Any]) -> Any:
    """Run ``step`` (the optimizer's own update) with ``foreach=True`` on the groups of a
    foreach-eligible SGD (``elements``: :func:`foreach_sgd_elements`, nonzero) that take it
    (see the module), each set back to None afterwards."""
    if torch.compiler.is_compiling():
        return step()
    switched = [g for g in optimizer.param_groups if _foreach_group(g, elements)]
    for group in switched:
        group["foreach"] = True
    try:
        return step()
    finally:
        for group in switched:
            group["foreach"] = None
