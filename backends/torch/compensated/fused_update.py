"""The fused update of compensated bfloat16 weights for torch's SGD, Adam and AdamW (CPU).

The generic path (:class:`~mixprec_torch.compensated.compensation.Compensation`) runs any optimizer
on float32 working masters: fill them from the bfloat16 weights, let the optimizer update them,
round them back; about six sweeps over the parameters besides the update itself. For
``torch.optim.SGD``, ``Adam`` and ``AdamW`` on the CPU (no ``amsgrad``, ``capturable`` or
``differentiable``) this module replaces all of it with one pass per tensor that reads the
bfloat16 weight, its compensation (kahan), the gradient and the optimizer state, applies the
optimizer's update rule in float32 and writes them back: rounded to nearest with the residual
kept (kahan), or rounded stochastically (stochastic; the state too under
``state="bfloat16"``). Float32 parameters of the same optimizer (modules pinned to float32)
are updated in place by the same pass.

The update rule is the optimizer's, each float32 operation rounded once
(:mod:`mixprec_torch.cpu.update_rule`, shared with the low-bit state's fused step); it agrees
with torch's own implementations to a few float32 ulps, not bit for bit. The optimizer state
keeps torch's format (``step``, ``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``), so
checkpoints move between this path, the generic path and an unwrapped optimizer.

Two implementations give the same bits: the native kernel (:func:`mixprec_torch.cpu.clib.update`,
one call for all tensors) and :func:`_run_torch`, the same operations as torch calls, used where
the kernel cannot be built.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..cpu import clib
from ..cpu.noise import round_stochastic_
from ..cpu.update_rule import (
    ADAM,
    algo_of,
    bias_corrections,
    hyper,
    options_fusable,
    rule_torch,
)
from ..step.optimizer_state import base_class

__all__ = ["FusedParam", "fusable", "fusable_options", "fusable_params", "run"]

PLAIN, KAHAN, STOCHASTIC = 0, 1, 2


@dataclass
class FusedParam:
    """How the fused pass sees one of the optimizer's parameters."""

    weight: torch.Tensor
    """The bfloat16 model parameter (kahan, stochastic) or the float32 parameter (plain)."""
    comp: torch.Tensor | None
    """Kahan: the bfloat16 compensation (a view of the flat buffer)."""
    index: int
    """The position of its first element in the device's noise pass."""
    mode: int
    """PLAIN, KAHAN or STOCHASTIC."""
    bf16_state: bool
    """The optimizer state of this parameter is kept in bfloat16 (``state="bfloat16"``)."""


def _is_cpu_float(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()


def fusable(
    optimizer: torch.optim.Optimizer, lookup: Callable[[torch.Tensor], FusedParam | None]
) -> bool:
    """Whether every parameter group of ``optimizer`` can take the fused update: its options
    (:func:`fusable_options`) and its parameters (:func:`fusable_params`).

    :param lookup: the compensated view of a parameter of the optimizer (a master), None for
        a parameter the strategy does not handle (which must then be a float32 CPU tensor).
    """
    return fusable_options(optimizer) and fusable_params(optimizer, lookup)


def fusable_options(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's class and every parameter group's options take the fused
    update (one look per group: the step asks every time, as options may change)."""
    return options_fusable(base_class(optimizer), optimizer.param_groups)


def fusable_params(
    optimizer: torch.optim.Optimizer, lookup: Callable[[torch.Tensor], FusedParam | None]
) -> bool:
    """Whether every parameter of the optimizer's class and groups can take the fused
    update: a weight the strategy handles is a contiguous CPU tensor, any other parameter a
    contiguous float32 CPU one (a walk over every parameter: the step asks once per layout
    of the groups, :attr:`mixprec_torch.step.optimizer_state.Layout.fusable`).

    :param lookup: as for :func:`fusable`.
    """
    if algo_of(base_class(optimizer)) is None:
        return False
    for group in optimizer.param_groups:
        for master in group["params"]:
            found = lookup(master)
            if found is None:
                if not _is_cpu_float(master, torch.float32):
                    return False
            elif found.weight.device.type != "cpu" or not found.weight.is_contiguous():
                return False
    return True


@dataclass
class _Item:
    param: FusedParam
    grad: torch.Tensor
    s0: torch.Tensor | None
    s1: torch.Tensor | None
    step_size: float = 0.0
    inv_bc2: float = 0.0
    first: bool = False


def _zeros(like: torch.Tensor, bf16: bool) -> torch.Tensor:
    return torch.zeros(like.shape, dtype=torch.bfloat16 if bf16 else torch.float32)


def _state_tensor(state: dict[str, Any], key: str, like: torch.Tensor, bf16: bool) -> torch.Tensor:
    """``state[key]`` in the dtype and layout the pass needs (fixed in place when not)."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    value = state.get(key)
    if not isinstance(value, torch.Tensor) or value.shape != like.shape:
        value = state[key] = _zeros(like, bf16)
    elif value.dtype != dtype or not value.is_contiguous() or value.device.type != "cpu":
        value = state[key] = value.detach().to(device="cpu", dtype=dtype).contiguous()
    return value


def _items(
    optimizer: torch.optim.Optimizer,
    group: dict[str, Any],
    algo: int,
    lookup: Callable[[torch.Tensor], FusedParam | None],
    grad_of: Callable[[torch.Tensor, FusedParam | None], torch.Tensor | None],
) -> list[_Item]:
    items: list[_Item] = []
    momentum = group.get("momentum", 0.0)
    steps: list[torch.Tensor] = []
    for master in group["params"]:
        found = lookup(master)
        grad = grad_of(master, found)
        if grad is None:
            continue
        if grad.is_sparse:
            raise RuntimeError("sparse gradients take the generic path")  # checked before
        param = found or FusedParam(master, None, 0, PLAIN, False)
        if not grad.is_contiguous():
            grad = grad.contiguous()
        state = optimizer.state[master]
        if algo == ADAM:
            if "step" not in state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
            steps.append(state["step"])
            s0 = _state_tensor(state, "exp_avg", grad, param.bf16_state)
            s1 = _state_tensor(state, "exp_avg_sq", grad, param.bf16_state)
            items.append(_Item(param, grad, s0, s1))
        elif momentum != 0.0:
            buf = state.get("momentum_buffer")
            first = not isinstance(buf, torch.Tensor) or buf.shape != grad.shape
            if first:
                buf = state["momentum_buffer"] = torch.empty(
                    grad.shape, dtype=torch.bfloat16 if param.bf16_state else torch.float32
                )
            else:
                buf = _state_tensor(state, "momentum_buffer", grad, param.bf16_state)
            items.append(_Item(param, grad, buf, None, first=first))
        else:
            items.append(_Item(param, grad, None, None))
    if steps:  # torch's single-tensor Adam: step += 1, then the bias corrections in float64
        for item, factors in zip(items, bias_corrections(group, steps), strict=True):
            item.step_size, item.inv_bc2 = factors
    return items


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _run_native(lib: Any, items: list[_Item], hyper: clib.Hyper) -> None:
    codes = clib.DTYPE_CODES
    starts = array.array("q", [0])
    for item in items:
        starts.append(starts[-1] + item.grad.numel())
    arrays: dict[str, array.array[Any]] = {
        "w": array.array("Q", [i.param.weight.data_ptr() for i in items]),
        "c": array.array("Q", [_ptr(i.param.comp) for i in items]),
        "g": array.array("Q", [i.grad.data_ptr() for i in items]),
        "s0": array.array("Q", [_ptr(i.s0) for i in items]),
        "s1": array.array("Q", [_ptr(i.s1) for i in items]),
        "starts": starts,
        "index": array.array("q", [i.param.index for i in items]),
        "step_size": array.array("f", [i.step_size for i in items]),
        "inv_bc2": array.array("f", [i.inv_bc2 for i in items]),
        "wmode": array.array("i", [i.param.mode for i in items]),
        "gdt": array.array("i", [codes[i.grad.dtype] for i in items]),
        "sdt": array.array("i", [int(i.param.bf16_state) for i in items]),
        "first": array.array("i", [int(i.first) for i in items]),
    }
    fields = clib.Items(**{k: v.buffer_info()[0] for k, v in arrays.items()})
    clib.update(lib, len(items), fields, hyper)


def _store_state(target: torch.Tensor, value: torch.Tensor, key: int, index: int) -> None:
    if target.dtype == torch.bfloat16:
        round_stochastic_(value, key, index)  # exact in bfloat16 now
    target.copy_(value)


def _run_torch(items: list[_Item], h: clib.Hyper) -> None:
    """The kernel's arithmetic with torch operations: the same bits, more passes."""
    for item in items:
        p = item.param
        w = p.weight
        x = w.float()  # every operation below is out of place: w itself is written last
        if p.mode == KAHAN:
            assert p.comp is not None
            x = x + p.comp.float()
        s0 = None if item.s0 is None or item.first else item.s0.float()
        s1 = None if item.s1 is None else item.s1.float()
        x, m, v = rule_torch(
            h,
            x,
            item.grad.float(),
            s0,
            s1,
            first=item.first,
            step_size=item.step_size,
            inv_bc2=item.inv_bc2,
        )
        if item.s1 is not None and v is not None:
            _store_state(item.s1, v, h.key_s1, p.index)
        if item.s0 is not None and m is not None:
            _store_state(item.s0, m, h.key_s0, p.index)
        if p.mode == PLAIN:
            w.copy_(x)
        elif p.mode == KAHAN:
            assert p.comp is not None
            rounded = x.to(torch.bfloat16)
            w.copy_(rounded)
            p.comp.copy_(x - rounded.float())
        else:
            round_stochastic_(x, h.key_w, p.index)
            w.copy_(x)


def run(
    optimizer: torch.optim.Optimizer,
    lookup: Callable[[torch.Tensor], FusedParam | None],
    grad_of: Callable[[torch.Tensor, FusedParam | None], torch.Tensor | None],
    keys: Sequence[int],
) -> None:
    """The fused update of every parameter group (call :func:`fusable` first).

    :param lookup: as for :func:`fusable`.
    :param grad_of: the gradient the update applies for a parameter (a master) of the
        optimizer, None to leave it (and its state) untouched this step, as torch does.
    :param keys: the noise keys of the weights' pass and the two state slots.
    """
    algo = algo_of(base_class(optimizer))
    assert algo is not None, "call fusable() first"
    lib = clib.library()
    with torch.no_grad():
        for group in optimizer.param_groups:
            items = _items(optimizer, group, algo, lookup, grad_of)
            if not items:
                continue
            h = hyper(group, algo, keys)
            if lib is not None:
                _run_native(lib, items, h)
            else:
                _run_torch(items, h)
