"""``"adamw"`` for Gluon: MXNet 1.9.1 registers no AdamW optimizer, only its update kernel.

Importing this module (the Trainer does) registers :class:`AdamW` under ``"adamw"`` unless
MXNet already has one, so ``Trainer(net, "adamw", {...})`` works, with PyTorch's decoupled
weight decay: ``w -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * w)``. It runs MXNet's fused
``contrib.adamw_update`` kernel, on float32 weights: under a mixprec policy those are the
float32 masters, and its moments are float32 like them. As in MXNet's ``adam``, ``eps`` is
added to ``sqrt(v)`` before the bias correction of ``v``.
"""

from __future__ import annotations

import math
from typing import Any

import mxnet as mx
from mxnet import nd

from ..gluon_private import optimizer_step

__all__ = ["AdamW"]


class AdamW(mx.optimizer.Optimizer):  # type: ignore[misc]
    """Adam with decoupled weight decay (Loshchilov & Hutter), as ``torch.optim.AdamW``.

    :param wd: the decoupled weight decay (default 0.01, PyTorch's).
    """

    def __init__(
        self,
        learning_rate: float = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
        wd: float = 0.01,
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate=learning_rate, wd=wd, **kwargs)
        self.beta1, self.beta2, self.epsilon = beta1, beta2, epsilon

    def create_state(self, index: int, weight: nd.NDArray) -> tuple[nd.NDArray, nd.NDArray]:
        """First and second moments, zero, in the weight's dtype and context."""
        zeros = (nd.zeros(weight.shape, weight.context, dtype=weight.dtype) for _ in range(2))
        return tuple(zeros)  # type: ignore[return-value]

    def update(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        """One AdamW step of ``weight`` (or of each weight when given lists)."""
        if isinstance(index, (list, tuple)):
            for i, w, g, s in zip(index, weight, grad, state, strict=True):
                self.update(i, w, g, s)
            return
        lr, wd, t = optimizer_step(self, index)
        correction = math.sqrt(1.0 - self.beta2**t) / (1.0 - self.beta1**t)
        mean, var = state
        clip = self.clip_gradient if self.clip_gradient is not None else -1.0
        nd.contrib.adamw_update(
            weight, grad, mean, var, rescale_grad=self.rescale_grad, lr=correction, eta=lr,
            beta1=self.beta1, beta2=self.beta2, epsilon=self.epsilon, wd=wd,
            clip_gradient=clip, out=weight,
        )  # fmt: skip


if "adamw" not in mx.optimizer.Optimizer.opt_registry:
    mx.optimizer.Optimizer.register(AdamW)
