"""The update rules of torch's SGD, Adam and AdamW as the fused passes apply them: which
optimizers and group options they take, the scalars of a group (:class:`~.clib.Hyper`), the
step counters and bias corrections, and the rule as torch operations (the twin of the C's).

Two fused passes share them: the compensated bfloat16 weights'
(:mod:`mixprec_torch.compensated.fused_update`) and the low-bit optimizer state's
(:mod:`mixprec_torch.lowbit.fused_step`). The rule is the optimizer's, each float32
operation rounded once (SGD: weight decay, momentum with dampening, Nesterov, ``maximize``;
Adam: ``m += (g - m)(1 - b1)``, ``v = v b2 + g² (1 - b2)``,
``x -= (m / (√v / √(1 - b2ᵗ) + eps)) lr / (1 - b1ᵗ)`` with the reciprocal square root of the
bias correction as a float32 factor; AdamW's decoupled decay ``x *= 1 - lr wd``). It agrees
with torch's own implementations to a few float32 ulps, not bit for bit (torch's kernels fuse
some of these operations differently per CPU).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..torch_private import foreach_add_
from . import clib

__all__ = [
    "ADAM",
    "SGD",
    "algo_of",
    "bias_corrections",
    "f32",
    "hyper",
    "options_fusable",
    "rule_torch",
]

SGD, ADAM = 0, 1
_ALGOS: dict[type, int] = {
    torch.optim.SGD: SGD,
    torch.optim.Adam: ADAM,
    torch.optim.AdamW: ADAM,
}
# The parameter-group keys the fused passes honour, per rule: the ones they read, the ones
# that only pick torch's implementation (which a fused pass replaces) or that an LR scheduler
# or SWA keeps for itself, and those honoured only when off. Any other key (an option a
# later torch adds, another library's) takes the generic path, which runs the optimizer's
# own step.
_READ = {
    SGD: {"params", "lr", "weight_decay", "maximize", "momentum", "dampening", "nesterov"},
    ADAM: {"params", "lr", "weight_decay", "maximize", "betas", "eps", "decoupled_weight_decay"},
}
_NEUTRAL = {"foreach", "fused", "param_names", "initial_lr", "max_lr", "min_lr", "swa_lr"}
_NEUTRAL |= {"base_momentum", "max_momentum"}
_ONLY_OFF = {SGD: {"differentiable"}, ADAM: {"amsgrad", "capturable", "differentiable"}}


def algo_of(base: type) -> int | None:
    """The rule of an optimizer's own class (:data:`SGD`, :data:`ADAM`); None for any other
    class, a subclass of these included (its ``step`` may differ)."""
    return _ALGOS.get(base)


def options_fusable(base: type, param_groups: Iterable[dict[str, Any]]) -> bool:
    """Whether the optimizer's own class ``base`` and every parameter group's options take a
    fused pass (one look per group: the step asks every time, as options may change)."""
    algo = _ALGOS.get(base)
    if algo is None:
        return False
    known = _READ[algo] | _NEUTRAL | _ONLY_OFF[algo]
    for group in param_groups:
        if not known.issuperset(group) or any(group.get(k) for k in _ONLY_OFF[algo]):
            return False
        if algo == ADAM and not all(isinstance(b, float) for b in group["betas"]):
            return False
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and (lr.numel() != 1 or lr.device.type != "cpu"):
            return False
    return True


def hyper(group: dict[str, Any], algo: int, keys: Sequence[int] = (0, 0, 0)) -> clib.Hyper:
    """The group's rule and scalars as the kernels take them (``keys``: the stochastic
    rounding's noise keys of the weights and the two state slots, where rounded so)."""
    lr = float(group["lr"])
    wd = float(group.get("weight_decay", 0.0))
    out = clib.Hyper()
    out.algo = algo
    out.maximize = int(bool(group.get("maximize", False)))
    out.lr = lr
    out.weight_decay = wd
    out.key_w, out.key_s0, out.key_s1 = keys
    if algo == ADAM:
        beta1, beta2 = group["betas"]
        out.decoupled = int(bool(group.get("decoupled_weight_decay", False)))
        out.decay_mul = 1.0 - lr * wd
        out.beta1, out.omb1 = beta1, 1.0 - beta1
        out.beta2, out.omb2 = beta2, 1.0 - beta2
        out.eps = float(group["eps"])
    else:
        out.momentum = float(group.get("momentum", 0.0))
        out.omd = 1.0 - float(group.get("dampening", 0.0))
        out.nesterov = int(bool(group.get("nesterov", False)))
    return out


def bias_corrections(group: dict[str, Any], steps: list[torch.Tensor]) -> list[tuple[float, float]]:
    """Adam's step counters of a group's updated parameters, counted on (``step += 1``, as
    torch's single-tensor Adam does), and each one's ``(lr / (1 - b1ᵗ), 1 / √(1 - b2ᵗ))`` in
    float64, as the kernels take them."""
    if not steps:
        return []
    foreach_add_(steps, 1.0)
    beta1, beta2 = group["betas"]
    lr = float(group["lr"])
    cache: dict[float, tuple[float, float]] = {}
    out = []
    for count in torch.stack(steps).tolist():
        if count not in cache:
            cache[count] = (lr / (1.0 - beta1**count), 1.0 / math.sqrt(1.0 - beta2**count))
        out.append(cache[count])
    return out


def f32(x: float) -> float:
    """``x`` rounded to float32, as the kernels receive it."""
    return float(torch.tensor(x, dtype=torch.float32))


def rule_torch(
    h: clib.Hyper,
    x: torch.Tensor,
    g: torch.Tensor,
    s0: torch.Tensor | None,
    s1: torch.Tensor | None,
    *,
    first: bool = False,
    step_size: float = 0.0,
    inv_bc2: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The kernels' update rule with torch operations, out of place: the new weight and state
    ``(x, s0, s1)`` from float32 weight ``x``, gradient ``g`` and state (Adam: ``exp_avg``,
    ``exp_avg_sq``; SGD: the momentum buffer or None). ``first``: SGD's momentum buffer
    starts as the gradient (``s0`` is not read)."""
    lr, wd = f32(h.lr), f32(h.weight_decay)
    if h.maximize:
        g = g.neg()
    if h.algo == ADAM:
        assert s0 is not None and s1 is not None
        if wd != 0.0:
            if h.decoupled:
                x = x * f32(h.decay_mul)
            else:
                g = g + x * wd
        m = s0 + (g - s0) * f32(h.omb1)
        v = s1 * f32(h.beta2) + (g * g) * f32(h.omb2)
        # correctly rounded, as the kernel's sqrtf: torch's float32 sqrt on the CPU is not
        # (it differs from IEEE in about one element in five, and between CPU builds)
        d = v.double().sqrt().float() * f32(inv_bc2) + f32(h.eps)
        return x - (m / d) * f32(step_size), m, v
    if wd != 0.0:
        g = g + x * wd
    buf = None
    if s0 is not None or first:
        momentum = f32(h.momentum)
        if first:
            buf = g.clone()
        else:
            assert s0 is not None
            buf = s0 * momentum + g * f32(h.omd)
        g = g + buf * momentum if h.nesterov else buf
    return x - g * lr, buf, None
