"""The FP8 linear layer: an ``autograd.Function`` for its three GEMMs, and the forward that
``wrap`` gives each ``nn.Linear`` the policy runs in FP8.

Forward ``y = x @ w.T + b``: ``x`` and ``w`` in e4m3, scaled along the input features;
backward: ``grad_x = g @ w`` with ``g`` in e5m2 and ``w`` in e4m3, both scaled along the
output features, and ``grad_w = g.T @ x`` with both scaled along the batch
(:mod:`mixprec.fp8`). Per-tensor recipes (tensorwise, delayed) reuse the forward's FP8
operands in the backward, so the layer keeps one byte per input element for the backward
instead of two; the per-row and per-block recipes scale along another dimension there, so
they keep the input as it came. The gradients come out in the dtypes of what they are the
gradients of (the weight's float32 under O1), rounded once from float32; the bias gradient
is a float32 sum.

The layer's forward is a :class:`FP8Forward` set as the module's ``forward`` attribute (the
module stays an ``nn.Linear``, its ``state_dict`` unchanged), like torchao's swap to
``Float8Linear`` but decided per module by the policy. It runs with autocast off (the
GEMMs' output dtype is the policy's), and contains no data-dependent Python branch, so a
compiled model traces it without a graph break.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mixprec.kit import BACKWARD_FORMAT, FORWARD_FORMAT

from ..copies import CopyOnly
from .numerics import Quantised, quantise, quantise_tensor, scaled_gemm

__all__ = ["DelayedTensors", "FP8Forward", "FP8LinearFunction"]


class DelayedTensors(CopyOnly):
    """One layer's part of the delayed recipe, on the layer's device: the scales of its
    input, weight and output gradient for this step (``scales``, 0 where a tensor has no
    history yet), and the largest amax each showed during the step (``amax`` for the input
    and the weight, ``amax_grad`` for the output gradient; -1 until seen)."""

    def __init__(self, device: torch.device) -> None:
        self.scales = torch.zeros(3, dtype=torch.float32, device=device)
        self.amax = torch.full((2,), -1.0, dtype=torch.float32, device=device)
        self.amax_grad = torch.full((), -1.0, dtype=torch.float32, device=device)

    def reset(self) -> None:
        """Forget the amaxes of the step (after it was settled)."""
        self.amax.fill_(-1.0)
        self.amax_grad.fill_(-1.0)


def _transposed(q: Quantised) -> Quantised:
    # a per-tensor operand scaled along one dimension is the same along the other
    return Quantised(q.q.t(), q.inverse, q.scale)


def _flat(part: Quantised | torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(part) if isinstance(part, Quantised) else (part,)


class FP8LinearFunction(torch.autograd.Function):
    """``linear(x, w, b)`` as FP8 GEMMs; returns the output and the forward amaxes (input,
    weight) for the delayed recipe (not differentiable)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        recipe: str,
        native: bool,
        out_dtype: torch.dtype,
        scales: torch.Tensor | None,
        amax_grad: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x2 = x.reshape(-1, x.shape[-1])
        with torch.autocast(x.device.type, enabled=False):
            if recipe in ("tensorwise", "delayed"):
                sx = None if scales is None else scales[0]
                sw = None if scales is None else scales[1]
                qx, amax_x = quantise_tensor(x2, FORWARD_FORMAT, recipe, sx)
                qw, amax_w = quantise_tensor(weight, FORWARD_FORMAT, recipe, sw)
                amaxes = torch.stack((amax_x, amax_w))
                saved: tuple[Quantised | torch.Tensor, ...] = (qx, qw)
            else:
                qx = quantise(x2, FORWARD_FORMAT, recipe, 1)
                qw = quantise(weight, FORWARD_FORMAT, recipe, 1)
                amaxes = torch.zeros(2, dtype=torch.float32, device=x.device)
                saved = (x2, weight)
            y = scaled_gemm(qx, qw, bias, out_dtype, native=native)
        # the weight is needed only for the input's gradient, the input only for the weight's
        need_x, need_w = ctx.needs_input_grad[:2]
        kept = [t for t in _flat(saved[0]) if need_w] + [t for t in _flat(saved[1]) if need_x]
        ctx.save_for_backward(*kept, scales, amax_grad)
        ctx.recipe, ctx.native = recipe, native
        ctx.shapes = (x.shape, x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(amaxes)
        return y.reshape(*x.shape[:-1], weight.shape[0]), amaxes

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_y: torch.Tensor, _grad_amaxes: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        *kept, scales, amax_grad = ctx.saved_tensors
        x_shape, x_dtype, w_dtype, b_dtype = ctx.shapes
        recipe, native = ctx.recipe, ctx.native
        g2 = grad_y.reshape(-1, grad_y.shape[-1])
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        with torch.autocast(g2.device.type, enabled=False):
            if recipe in ("tensorwise", "delayed"):
                sg = None if scales is None else scales[2]
                qg, amax_g = quantise_tensor(g2, BACKWARD_FORMAT, recipe, sg)
                if amax_grad is not None:
                    amax_grad.copy_(torch.maximum(amax_grad, amax_g))
                if need_w:
                    qx, kept = Quantised(*kept[:3]), kept[3:]
                    grad_w = scaled_gemm(
                        _transposed(qg), _transposed(qx), None, w_dtype, native=native
                    )
                if need_x:
                    qw = Quantised(*kept[:3])
                    grad_x = scaled_gemm(qg, _transposed(qw), None, x_dtype, native=native)
            else:
                x2 = kept.pop(0) if need_w else None
                weight = kept.pop(0) if need_x else None
                if need_x:
                    assert weight is not None
                    qg = quantise(g2, BACKWARD_FORMAT, recipe, 1)
                    qw = quantise(weight.t(), FORWARD_FORMAT, recipe, 1)
                    grad_x = scaled_gemm(qg, qw, None, x_dtype, native=native)
                if need_w:
                    assert x2 is not None
                    qg_t = quantise(g2.t(), BACKWARD_FORMAT, recipe, 1)
                    qx_t = quantise(x2.t(), FORWARD_FORMAT, recipe, 1)
                    grad_w = scaled_gemm(qg_t, qx_t, None, w_dtype, native=native)
            if need_b:
                grad_b = g2.float().sum(0).to(b_dtype)
        if grad_x is not None:
            grad_x = grad_x.reshape(x_shape)
        return grad_x, grad_w, grad_b, None, None, None, None, None


class FP8Forward(CopyOnly):
    """The ``forward`` of one ``nn.Linear`` that runs in FP8 (set as its instance attribute).

    :param module: the layer.
    :param recipe: the recipe's name.
    :param out_dtype: the dtype of the output (the policy's compute dtype).
    :param native: whether ``torch._scaled_mm`` runs the recipe on the layer's device.
    :param delayed: the layer's delayed-scaling tensors (``delayed`` only).
    """

    def __init__(
        self,
        module: nn.Linear,
        recipe: str,
        out_dtype: torch.dtype,
        *,
        native: bool,
        delayed: DelayedTensors | None = None,
    ) -> None:
        self.module = module
        self.recipe = recipe
        self.out_dtype = out_dtype
        self.native = native
        self.delayed = delayed
        self.__wrapped__ = type(module).forward.__get__(module)  # what signature() reads

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        module, delayed = self.module, self.delayed
        scales = None if delayed is None else delayed.scales
        recording = delayed is not None and torch.is_grad_enabled()
        y, amaxes = FP8LinearFunction.apply(
            input,
            module.weight,
            module.bias,
            self.recipe,
            self.native,
            self.out_dtype,
            scales,
            delayed.amax_grad if recording and delayed is not None else None,
        )
        if recording and delayed is not None:  # the largest amax of the step is kept
            delayed.amax.copy_(torch.maximum(delayed.amax, amaxes))
        return y  # type: ignore[no-any-return]
