"""The NumPy backend's entry into mixprec's conformance suite (:mod:`mixprec.testing`).

The adapter runs one op under a policy and reports the dtype it computed in; the trainer is
a small MLP with momentum SGD that always trains on the same batch.
"""

from __future__ import annotations

import io

import numpy as np

from mixprec.errors import PolicyError
from mixprec.kit import LOWBIT_FORMATS, MX_BLOCK, Policy, lowbit_format
from mixprec_numpy.casting import Tensor, cast
from mixprec_numpy.devices import check_dtype, resolve_policy
from mixprec_numpy.fp8 import quantise
from mixprec_numpy.layers import MLP, Linear, ReLU, SoftmaxCrossEntropy, softmax
from mixprec_numpy.lowbit import dequantize, quantize
from mixprec_numpy.optimizer import SGD
from mixprec_numpy.trainer import Trainer

__all__ = ["NumpyConformanceAdapter", "NumpyConformanceTrainer"]

SUPPORTED_OPS = ("linear", "relu", "softmax", "cross_entropy")


class NumpyConformanceAdapter:
    """Implements :class:`mixprec.testing.ConformanceAdapter` for the NumPy backend."""

    name = "numpy"
    master_strategies = ("kahan", "stochastic")
    state_dtypes = ("bfloat16", *LOWBIT_FORMATS)
    device = "cpu"

    def supported_ops(self) -> tuple[str, ...]:
        return SUPPORTED_OPS

    def op_dtype(self, policy: Policy, op: str, input_dtype: str) -> str:
        policy = resolve_policy(policy, self.device)
        check_dtype(input_dtype, "the op's inputs")
        rng = np.random.default_rng(0)
        x = Tensor(cast(rng.standard_normal((4, 3)), input_dtype), input_dtype)
        if op == "linear":
            layer = Linear(3, 2, rng=rng)
            for p in layer.parameters():
                p.cast_(input_dtype)
            return layer.forward(x, policy).dtype
        if op == "relu":
            return ReLU().forward(x, policy).dtype
        if op == "softmax":
            return softmax(x, policy).dtype
        if op == "cross_entropy":
            loss = SoftmaxCrossEntropy()
            loss.forward(x, np.array([0, 1, 2, 0]), policy)
            return loss.dtype
        raise PolicyError(f"the NumPy backend has no {op!r} op; it has {', '.join(SUPPORTED_OPS)}")

    def make_trainer(self, policy: Policy, seed: int = 0) -> NumpyConformanceTrainer:
        return NumpyConformanceTrainer(policy, seed)

    def fp8_quantise(
        self, recipe: str, fmt: str, rows: list[list[float]], scale: float | None
    ) -> tuple[list[list[float]], list[float]]:
        """``rows`` in ``fmt`` under ``recipe`` along the last axis (:mod:`.fp8`)."""
        quantised = quantise(np.array(rows, np.float32), fmt, recipe, axis=1, scale=scale)
        scales = quantised.scale
        if recipe == "mxfp8":  # one per element, constant over each block: its first
            scales = scales[:, ::MX_BLOCK]
        return quantised.q.tolist(), np.ravel(scales).tolist()

    def lowbit_quantize(
        self, state: str, signed: bool, values: list[float]
    ) -> tuple[list[int], list[float], list[float]]:
        """``values`` encoded and decoded again by :mod:`mixprec_numpy.lowbit`."""
        fmt = lowbit_format(state)
        q = quantize(np.array(values, np.float32), fmt, signed)
        decoded = dequantize(q, fmt, signed, len(values))
        return q.codes.tolist(), q.absmax.tolist(), decoded.tolist()


class NumpyConformanceTrainer:
    """Implements :class:`mixprec.testing.ConformanceTrainer`: a 6-8-3 MLP, momentum SGD."""

    def __init__(self, policy: Policy, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.x = rng.standard_normal((16, 6)).astype(np.float32)
        self.y = rng.integers(0, 3, 16)
        self.model = MLP([6, 8, 3], seed=seed)
        self.trainer = Trainer(self.model, SGD(lr=0.05, momentum=0.9), policy)

    def step(self, inject_inf: bool = False) -> float:
        loss = self.model.loss(self.x, self.y)
        self.trainer.backward()
        if inject_inf:
            grad = self.model.parameters()[0].grad
            assert grad is not None
            grad.flat[0] = np.inf
        self.trainer.step()
        return loss

    def params(self) -> dict[str, list[float]]:
        return {p.name: p.data.astype(np.float32).ravel().tolist() for p in self.model.parameters()}

    def master_params(self) -> dict[str, list[float]]:
        compensation = self.trainer.compensation
        if compensation is not None:
            return {p.name: compensation.best(p).ravel().tolist() for p in self.model.parameters()}
        return {
            p.name: m.data.astype(np.float32).ravel().tolist()
            for p, m in self.trainer.masters.pairs
        }

    def optimizer_state(self) -> dict[str, list[float]]:
        state = {name: v.ravel().tolist() for name, v in self.trainer.optimizer.state.items()}
        lowbit = self.trainer.lowbit  # under a low-bit state: the codes and absmax
        if lowbit is not None:
            state.update((n, v.astype(np.float32).tolist()) for n, v in lowbit.state_dict().items())
        return state

    def loss_scale(self) -> float:
        return self.trainer.loss_scale

    def skipped_steps(self) -> int:
        return self.trainer.skipped_steps

    def checkpoint(self) -> bytes:
        buffer = io.BytesIO()
        self.trainer.save(buffer)
        return buffer.getvalue()

    def restore(self, blob: bytes) -> None:
        self.trainer.load(io.BytesIO(blob))

    def saved_param_dtypes(self) -> set[str]:
        buffer = io.BytesIO()
        self.trainer.save_parameters(buffer)
        buffer.seek(0)
        with np.load(buffer, allow_pickle=False) as saved:
            return {str(saved[name].dtype) for name in saved.files}
