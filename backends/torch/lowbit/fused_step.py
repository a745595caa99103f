"""The fused step of float32 weights whose optimizer state is low-bit, for torch's SGD, Adam
and AdamW on the CPU.

The generic path (:meth:`~mixprec_torch.lowbit.state.LowBitState.widen`, the optimizer's own
``step``, :meth:`~mixprec_torch.lowbit.state.LowBitState.narrow`) decodes every state tensor
into a fresh float32 tensor, lets the optimizer update it and encodes it into fresh codes:
three sweeps over memory and a float32 copy of the whole state. Here one pass per tensor does
it block by block (:func:`mixprec_torch.cpu.clib.lowbit_update`): decode the block's moments,
apply the optimizer's rule in float32 (:mod:`mixprec_torch.cpu.update_rule`: the compensated
fused update's rule, each operation rounded once, a few ulps from torch's own), write the
weight, and encode the block again (its absmax over the new values, then the codes) over its
old codes. Parameters whose state the format keeps float32 (under ``min_size``, named by
``keep``) take the float32 fused update (:func:`mixprec_torch.cpu.clib.update`) in the same
step.

**What it takes** (:func:`plan`, asked before every step; anything else takes the generic
path): the optimizer's own class is ``SGD``, ``Adam`` or ``AdamW`` with options the fused
update honours (:func:`~mixprec_torch.cpu.update_rule.options_fusable`: no ``amsgrad``,
``capturable``, ``differentiable``); every parameter a contiguous float32 CPU tensor with a
dense float32 gradient (or none: skipped, as torch skips it; no ``DTensor``: FSDP2's shards
take the generic path); every quantized
parameter's state empty (its first step) or quantized under this format, with each key its
rule needs; a float32-kept parameter's state float32.

**Why the codes can be overwritten.** The generic path refuses a non-finite new moment with
the codes of before the step kept (:meth:`~mixprec_torch.lowbit.state.LowBitState.narrow`);
keeping them here would take a second copy of the codes every step (fresh memory, whose page
faults cost more than the pass). Instead :func:`plan` proves first that no new moment can be
inf or NaN, and leaves any step it cannot prove to the generic path: the hyperparameters in
torch's ranges (``0 <= beta < 1``, ``0 <= momentum, dampening <= 1``, a finite weight decay),
the quantized parameters' gradients (and weights, under L2 weight decay) at most
:data:`GRAD_BOUND` in magnitude and their moments' absmax at most :data:`STATE_BOUND`: then
``m + (g - m)(1 - b1)``, ``v b2 + g² (1 - b2)`` and ``buf momentum + g (1 - dampening)`` stay
far inside float32's range. One read of the gradients (:func:`mixprec_torch.cpu.clib.max_abs`)
buys that: a non-finite gradient, weight or moment, or an inf hyperparameter, takes the
generic path and its refusal. Where the step guard's pass of this step only read the
gradients (no loss scaling: :meth:`mixprec_torch.cpu.grad_check.GuardPlan.squares_of`), its
sum of squares bounds every gradient already (no square in the sum is larger), and that read
is the only one: the gradients are read again only where the sum does not prove the bound
(or the pass did not read them all, or one was written in place since).

Two implementations give the same bits: the kernels and :func:`_run_torch` (the twin codec
and :func:`~mixprec_torch.cpu.update_rule.rule_torch`), used where the kernels are not.
"""

from __future__ import annotations

import array
import ctypes
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import torch

from mixprec.kit import StateFormat

from ..cpu import clib
from ..cpu.update_rule import ADAM, algo_of, bias_corrections, hyper, options_fusable, rule_torch
from ..step.optimizer_state import base_class
from .codec import blocks_of, code_count, dequantize_torch, quantize_torch, tables
from .shards import is_sharded

__all__ = ["FORMAT_KEY", "GRAD_BOUND", "STATE_BOUND", "SUFFIX", "Moment", "Plan", "plan", "run"]

FORMAT_KEY = "mixprec.state"
SUFFIX = ".absmax"
GRAD_BOUND = 1e18
"""The largest gradient magnitude (after L2 weight decay) the fused step takes: its square,
1e36, is far inside float32's range (3.4e38)."""
STATE_BOUND = 1e37
"""The largest absmax of a moment before the step that the fused step takes."""
_ADAM_KEYS = (("exp_avg", True), ("exp_avg_sq", False))
_SGD_KEYS = (("momentum_buffer", True),)
_PLAIN = 0  # mp_update's float32 weight mode
_CPU = torch.device("cpu")


@dataclass
class Moment:
    """One quantized state tensor of one step."""

    state: dict[str, Any]
    key: str
    signed: bool
    codes: torch.Tensor
    """Its codes: the old ones, overwritten by the step (fresh on its first step)."""
    absmax: torch.Tensor
    first: bool
    """Its first step: nothing to decode (zeros; SGD's buffer starts as the gradient)."""


@dataclass
class _Param:
    param: torch.Tensor
    grad: torch.Tensor
    quantized: bool


@dataclass
class _Item:
    param: torch.Tensor
    grad: torch.Tensor
    quantized: bool
    moments: list[Moment] = field(default_factory=list)
    kept: list[torch.Tensor] = field(default_factory=list)
    """A float32-kept parameter's state tensors (Adam: exp_avg, exp_avg_sq; SGD: the buffer)."""
    first: bool = False
    step_size: float = 0.0
    inv_bc2: float = 0.0


@dataclass
class Plan:
    """A step :func:`plan` found fusable: the rule, the format, and per parameter group the
    parameters that have a gradient."""

    algo: int
    fmt: StateFormat
    tag: tuple[int, int]
    groups: list[tuple[dict[str, Any], list[_Param]]]


def _keys(algo: int, group: dict[str, Any]) -> tuple[tuple[str, bool], ...]:
    if algo == ADAM:
        return _ADAM_KEYS
    return _SGD_KEYS if group.get("momentum", 0.0) != 0.0 else ()


def _is_cpu(t: object, dtype: torch.dtype) -> TypeGuard[torch.Tensor]:
    """A plain contiguous CPU tensor of ``dtype`` (never a ``DTensor``: FSDP2's shards take
    the generic path, :mod:`.shards`)."""
    if not isinstance(t, torch.Tensor):
        return False
    kind = type(t)  # a plain tensor or parameter is no DTensor: no need to ask
    if kind is not torch.Tensor and kind is not torch.nn.Parameter and is_sharded(t):
        return False
    return t.dtype == dtype and t.is_cpu and t.layout == torch.strided and t.is_contiguous()


def _step_fits(state: dict[str, Any]) -> bool:
    step = state.get("step")
    return step is None or (_is_cpu(step, torch.float32) and step.numel() == 1)


def _state_fits(
    state: dict[str, Any],
    keys: tuple[tuple[str, bool], ...],
    fmt: StateFormat,
    tag: tuple[int, int],
    n: int,
) -> bool:
    """A quantized parameter's state: empty (its first step) or every key's codes under
    ``tag``."""
    if not _step_fits(state):
        return False
    if not any(key in state for key, _ in keys):
        return FORMAT_KEY not in state
    found = state.get(FORMAT_KEY)
    if not isinstance(found, tuple | list) or tuple(found) != tag:
        return False
    for key, _ in keys:
        codes, scale = state.get(key), state.get(key + SUFFIX)
        if not (_is_cpu(codes, torch.uint8) and _is_cpu(scale, torch.float32)):
            return False
        if codes.numel() != code_count(fmt, n) or scale.numel() != blocks_of(fmt, n):
            return False
    return True


def _kept_fits(
    state: dict[str, Any], keys: tuple[tuple[str, bool], ...], param: torch.Tensor
) -> bool:
    """A float32-kept parameter's state: each key absent or a floating tensor of its shape."""
    if FORMAT_KEY in state or not _step_fits(state):
        return False
    for key, _ in keys:
        value = state.get(key)
        if value is not None and not (
            isinstance(value, torch.Tensor)
            and value.is_floating_point()
            and value.shape == param.shape
        ):
            return False
    return True


def _in(value: object, low: float, high: float) -> bool:
    return isinstance(value, int | float) and low <= value <= high


def _ranges_fit(algo: int, group: dict[str, Any]) -> bool:
    """The group's hyperparameters in the ranges the bounds need (torch's own)."""
    if not math.isfinite(float(group.get("weight_decay", 0.0))):
        return False
    if algo == ADAM:
        return all(_in(b, 0.0, 1.0) and b < 1.0 for b in group["betas"])
    return _in(group.get("momentum", 0.0), 0.0, 1.0) and _in(group.get("dampening", 0.0), 0.0, 1.0)


def _max_abs(lib: ctypes.CDLL | None, tensors: list[torch.Tensor]) -> float:
    """The largest magnitude over ``tensors`` (NaN or inf where one is not finite)."""
    if not tensors:
        return 0.0
    if lib is not None:
        return clib.max_abs(lib, tensors)
    return max(float(t.detach().float().abs().max()) if t.numel() else 0.0 for t in tensors)


Squares = Callable[[list[torch.Tensor]], float | None]
"""The step guard's sum of squares over the given gradients, where its pass read them all
and none was written since (:meth:`mixprec_torch.cpu.grad_check.GuardPlan.squares_of`)."""


def _largest_grad(
    lib: ctypes.CDLL | None, grads: list[torch.Tensor], squares: float | None
) -> float:
    """A bound on the largest magnitude over ``grads``: from the guard's sum of squares when
    that proves them within :data:`GRAD_BOUND` (each square in it rounded once, at most 2^-24
    below the exact square; 2^-20 of room), else read (:func:`_max_abs`)."""
    if squares is not None and squares >= 0.0:
        bound = math.sqrt(squares) * (1.0 + 2.0**-20)
        if bound <= GRAD_BOUND:
            return bound
    return _max_abs(lib, grads)


def _bounded(
    algo: int,
    group: dict[str, Any],
    found: list[_Param],
    states: list[dict[str, Any]],
    squares: float | None,
) -> bool:
    """Whether the quantized parameters' gradients, weights (L2 decay) and moments are within
    the bounds that keep every new moment finite (see the module); ``squares``: the guard's
    sum of squares over every gradient of the optimizer, or None."""
    grads = [p.grad for p in found if p.quantized]
    if not grads:
        return True
    lib = clib.library()  # CPU tensors only here
    g = _largest_grad(lib, grads, squares)
    wd = abs(float(group.get("weight_decay", 0.0)))
    if wd != 0.0 and not (algo == ADAM and group.get("decoupled_weight_decay", False)):
        g += _max_abs(lib, [p.param for p in found if p.quantized]) * wd  # L2: g + x wd
    scales = [s[key + SUFFIX] for s in states for key, _ in _keys(algo, group) if key + SUFFIX in s]
    a = _max_abs(lib, scales)
    return g <= GRAD_BOUND and a <= STATE_BOUND  # False for NaN


def plan(
    optimizer: torch.optim.Optimizer,
    fmt: StateFormat,
    tag: tuple[int, int],
    quantized: Callable[[torch.Tensor], bool],
    squares: Squares | None = None,
) -> Plan | None:
    """The fused step's plan for ``optimizer`` now, None where it takes the generic path
    (see the module: what it takes, and the bounds). Changes nothing.

    :param squares: the step guard's sum of squares, asked once for every gradient the
        optimizer applies (see the module).
    """
    base = base_class(optimizer)
    algo = algo_of(base)
    if algo is None or not options_fusable(base, optimizer.param_groups):
        return None
    total: float | None = None
    if squares is not None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"]]
        total = squares([g for g in grads if g is not None])
    groups = []
    for group in optimizer.param_groups:
        keys = _keys(algo, group)
        found: list[_Param] = []
        states: list[dict[str, Any]] = []
        for param in group["params"]:
            if not _is_cpu(param, torch.float32):
                return None
            grad = param.grad
            if grad is not None and not (
                grad.dtype == torch.float32
                and grad.device.type == "cpu"
                and grad.layout == torch.strided
            ):
                return None
            state = optimizer.state.get(param, {})
            low = quantized(param)
            if low:
                if not _state_fits(state, keys, fmt, tag, param.numel()):
                    return None
            elif not _kept_fits(state, keys, param):
                return None
            if grad is not None:
                found.append(_Param(param, grad.contiguous(), low))
                if low:
                    states.append(state)
        if any(p.quantized for p in found) and not (
            _ranges_fit(algo, group) and _bounded(algo, group, found, states, total)
        ):
            return None
        groups.append((group, found))
    return Plan(algo, fmt, tag, groups)


def _kept_tensor(state: dict[str, Any], key: str, param: torch.Tensor) -> torch.Tensor:
    """A float32-kept state tensor in the layout the pass needs (fixed in place when not)."""
    value = state.get(key)
    if not isinstance(value, torch.Tensor):
        value = state[key] = torch.zeros_like(param)
    elif value.dtype != torch.float32 or not value.is_contiguous() or value.device.type != "cpu":
        value = state[key] = value.detach().to(device="cpu", dtype=torch.float32).contiguous()
    return value


def _items(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], params: list[_Param], p: Plan
) -> list[_Item]:
    """The group's parameters as the passes take them; the step counters counted on, and a
    first step's state made (codes, absmax, a float32-kept parameter's buffers)."""
    items: list[_Item] = []
    steps: list[torch.Tensor] = []
    keys = _keys(p.algo, group)
    for found in params:
        param = found.param
        item = _Item(param, found.grad, found.quantized)
        state = optimizer.state[param]
        if p.algo == ADAM:
            if "step" not in state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
            steps.append(state["step"])
        n = param.numel()
        if item.quantized:
            first = keys != () and keys[0][0] not in state
            if first:  # the keys in the order the generic path's first step leaves them
                for key, _ in keys:
                    state[key] = torch.empty(code_count(p.fmt, n), dtype=torch.uint8)
                for key, _ in keys:
                    state[key + SUFFIX] = torch.empty(blocks_of(p.fmt, n), dtype=torch.float32)
                    state[FORMAT_KEY] = p.tag
            for key, signed in keys:
                item.moments.append(
                    Moment(state, key, signed, state[key], state[key + SUFFIX], first)
                )
            item.first = first
        elif keys:
            item.first = p.algo != ADAM and "momentum_buffer" not in state
            if item.first:
                state["momentum_buffer"] = torch.empty_like(param)
            item.kept = [_kept_tensor(state, key, param) for key, _ in keys]
        items.append(item)
    if steps:  # torch's single-tensor Adam: step += 1, then the bias corrections in float64
        for item, factors in zip(items, bias_corrections(group, steps), strict=True):
            item.step_size, item.inv_bc2 = factors
    return items


# ------------------------------------------------------------------ the kernels


def _addresses(tensors: list[torch.Tensor | None]) -> array.array[int]:
    return array.array("Q", [0 if t is None else t.data_ptr() for t in tensors])


def _run_lowbit_native(lib: ctypes.CDLL, items: list[_Item], h: clib.Hyper, p: Plan) -> list[int]:
    """The quantized parameters through ``mp_lowbit_update``; each one's non-finite flags."""
    count = len(items)
    starts, bstarts = [0], [0]
    w, g, gdt, step_size, inv_bc2 = [], [], [], [], []
    # each moment's codes and absmax, new (o0, b0, o1, b1) and old (c0, a0, c1, a1: 0 where
    # none, or on the moment's first step)
    new = [[0] * count for _ in range(4)]
    old = [[0] * count for _ in range(4)]
    for i, item in enumerate(items):
        numel = item.param.numel()
        starts.append(starts[-1] + numel)
        bstarts.append(bstarts[-1] + blocks_of(p.fmt, numel))
        w.append(item.param.data_ptr())
        g.append(item.grad.data_ptr())
        gdt.append(clib.DTYPE_CODES[item.grad.dtype])
        step_size.append(item.step_size)
        inv_bc2.append(item.inv_bc2)
        for k, m in enumerate(item.moments[:2]):
            codes, scale = m.codes.data_ptr(), m.absmax.data_ptr()
            new[2 * k][i], new[2 * k + 1][i] = codes, scale
            if not m.first:
                old[2 * k][i], old[2 * k + 1][i] = codes, scale
    bad = array.array("i", [0] * count)
    arrays: dict[str, array.array[Any]] = {
        "w": array.array("Q", w),
        "g": array.array("Q", g),
        "c0": array.array("Q", old[0]),
        "a0": array.array("Q", old[1]),
        "c1": array.array("Q", old[2]),
        "a1": array.array("Q", old[3]),
        "o0": array.array("Q", new[0]),
        "b0": array.array("Q", new[1]),
        "o1": array.array("Q", new[2]),
        "b1": array.array("Q", new[3]),
        "starts": array.array("q", starts),
        "bstarts": array.array("q", bstarts),
        "step_size": array.array("f", step_size),
        "inv_bc2": array.array("f", inv_bc2),
        "gdt": array.array("i", gdt),
        "bad": bad,
    }
    fields = clib.LowbitItems(**{k: v.buffer_info()[0] for k, v in arrays.items()})
    signed = tables(p.fmt, True, _CPU).native(lib)
    unsigned = tables(p.fmt, False, _CPU).native(lib)
    clib.lowbit_update(lib, count, fields, h, signed, unsigned, p.fmt.block)
    return list(bad)


def _run_kept_native(lib: ctypes.CDLL, items: list[_Item], h: clib.Hyper) -> None:
    """The float32-kept parameters through ``mp_update`` (float32 weights and state)."""
    starts = array.array("q", [0])
    for item in items:
        starts.append(starts[-1] + item.param.numel())
    count = len(items)
    arrays: dict[str, array.array[Any]] = {
        "w": _addresses([i.param for i in items]),
        "c": array.array("Q", [0] * count),
        "g": _addresses([i.grad for i in items]),
        "s0": _addresses([i.kept[0] if i.kept else None for i in items]),
        "s1": _addresses([i.kept[1] if len(i.kept) > 1 else None for i in items]),
        "starts": starts,
        "index": array.array("q", [0] * count),
        "step_size": array.array("f", [i.step_size for i in items]),
        "inv_bc2": array.array("f", [i.inv_bc2 for i in items]),
        "wmode": array.array("i", [_PLAIN] * count),
        "gdt": array.array("i", [clib.DTYPE_CODES[i.grad.dtype] for i in items]),
        "sdt": array.array("i", [0] * count),
        "first": array.array("i", [int(i.first) for i in items]),
    }
    fields = clib.Items(**{k: v.buffer_info()[0] for k, v in arrays.items()})
    clib.update(lib, count, fields, h)


# ------------------------------------------------------------------ the twin


def _decoded(m: Moment, p: Plan, n: int) -> torch.Tensor | None:
    if m.first:
        return torch.zeros(n) if p.algo == ADAM else None
    return dequantize_torch(m.codes, m.absmax, p.fmt, m.signed, n)


def _run_torch(items: list[_Item], h: clib.Hyper, p: Plan) -> list[int]:
    """Both kinds of parameters with torch operations: the kernels' bits, more passes."""
    bad = []
    for item in items:
        n = item.param.numel()
        weight = item.param.detach().view(-1)
        if item.quantized:
            old = [_decoded(m, p, n) for m in item.moments]
        else:
            old = [None if item.first else t.view(-1) for t in item.kept]
        new_x, m0, m1 = rule_torch(
            h,
            weight,
            item.grad.float().view(-1),
            old[0] if old else None,
            old[1] if len(old) > 1 else None,
            first=item.first,
            step_size=item.step_size,
            inv_bc2=item.inv_bc2,
        )
        weight.copy_(new_x)
        new = [t for t in (m0, m1) if t is not None]
        flags = 0
        if item.quantized:
            for k, (m, value) in enumerate(zip(item.moments, new, strict=True)):
                codes, scale = quantize_torch(value, p.fmt, m.signed)
                if bool(torch.isfinite(scale).all()):
                    m.codes.copy_(codes)
                    m.absmax.copy_(scale)
                else:  # cannot happen under the plan's bounds; the kernel keeps such blocks
                    keep = ~torch.isfinite(scale)
                    m.absmax.copy_(torch.where(keep, m.absmax, scale))
                    mask = keep.repeat_interleave(p.fmt.block)
                    if p.fmt.bits == 4:
                        mask = mask[0::2]
                    mask = mask[: codes.numel()]
                    m.codes.copy_(torch.where(mask, m.codes, codes))
                    flags |= 1 << k
        else:
            for target, value in zip(item.kept, new, strict=True):
                target.view(-1).copy_(value)
        bad.append(flags)
    return bad


# ------------------------------------------------------------------ the step


def run(optimizer: torch.optim.Optimizer, p: Plan) -> Moment | None:
    """The fused step of every parameter group under :func:`plan`'s plan, made just before.

    :returns: None; or, where a new moment is not finite (which the plan's bounds rule out),
        the first such moment (its non-finite blocks kept their codes).
    """
    lib = clib.library()
    failed: Moment | None = None
    with torch.no_grad():
        for group, params in p.groups:
            items = _items(optimizer, group, params, p)
            if not items:
                continue
            h = hyper(group, p.algo)
            low = [i for i in items if i.quantized]
            kept = [i for i in items if not i.quantized]
            if lib is None:
                flags = _run_torch(low + kept, h, p)[: len(low)]
            else:
                flags = _run_lowbit_native(lib, low, h, p) if low else []
                if kept:
                    _run_kept_native(lib, kept, h)
            for item, flag in zip(low, flags, strict=True):
                if flag and failed is None:
                    failed = item.moments[(flag & -flag).bit_length() - 1]
    return failed
