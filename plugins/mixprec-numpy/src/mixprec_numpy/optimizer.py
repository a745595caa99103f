"""SGD with momentum, updating float32 master parameters.

The optimizer knows nothing about precision: the trainer hands it the masters (float32
copies, or the parameters themselves where no copy is needed) with unscaled float32
gradients, and copies the result back into the model.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from mixprec.errors import CheckpointError
from mixprec_numpy.casting import Array, cast, float32
from mixprec_numpy.layers import Parameter

__all__ = ["SGD"]


class SGD:
    """``v = momentum * v + grad; param -= lr * v`` (PyTorch's SGD without dampening)."""

    def __init__(self, lr: float = 0.01, momentum: float = 0.0) -> None:
        self.lr = lr
        self.momentum = momentum
        self.state: dict[str, Array] = {}
        """The momentum buffer of each parameter, by name (float32)."""

    def update(self, params: list[Parameter]) -> None:
        """One step on every parameter that has a gradient."""
        for p in params:
            if p.grad is None:
                continue
            step = float32(p.grad)
            if self.momentum:
                velocity = self.state.get(p.name)
                if velocity is not None:
                    step = np.float32(self.momentum) * velocity + step
                self.state[p.name] = step = np.array(step, np.float32)
            p.data = cast(float32(p.data) - np.float32(self.lr) * step, p.dtype)

    def moments(self, name: str) -> dict[str, bool]:
        """The keys of ``state`` that parameter ``name`` gets, each with whether its values
        take both signs: what a low-bit ``state`` quantizes (:mod:`mixprec_numpy.lowbit`)."""
        return {name: True} if self.momentum else {}

    def state_dict(self) -> dict[str, Array]:
        """The momentum buffers, copied."""
        return {name: v.copy() for name, v in self.state.items()}

    def check_state_dict(self, state: Mapping[str, Array]) -> None:
        """Raise :class:`~mixprec.errors.CheckpointError` unless ``state`` is loadable: float32
        arrays, finite (a NaN momentum would reach the weights at the next step)."""
        for name, v in state.items():
            if not isinstance(v, np.ndarray) or v.dtype != np.float32:
                raise CheckpointError(
                    f"optimizer state {name!r} is {getattr(v, 'dtype', type(v).__name__)}, "
                    "not float32"
                )
            if not np.isfinite(v).all():
                raise CheckpointError(
                    f"optimizer state {name!r} holds an inf or NaN; loaded, it would reach the "
                    "weights at the next step"
                )

    def load_state_dict(self, state: Mapping[str, Array]) -> None:
        """Restore :meth:`state_dict`'s output (checked whole first)."""
        self.check_state_dict(state)
        self.state = {name: np.array(v, np.float32) for name, v in state.items()}
