"""The torch backend's entry into mixprec's conformance suite (:mod:`mixprec.testing`).

:class:`TorchAdapter` runs one op family's representative call (the probes of
:mod:`mixprec_torch.ops`) inside the same op-casting region a wrapped model's forward runs
in, and builds :class:`TorchTrainer` s: a two-layer MLP with momentum SGD on a fixed batch,
wrapped with ``mixprec_torch.wrap`` and trained the way a user would.
"""

from __future__ import annotations

import io
from collections.abc import Collection
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.errors import UnsupportedDtypeError
from mixprec.kit import LOWBIT_FORMATS, MX_BLOCK, Policy, lowbit_format

from .devices import capabilities
from .dtypes import dtype_name, torch_dtype
from .fp8.numerics import quantise
from .lowbit.codec import dequantize
from .lowbit.codec import quantize as lowbit_quantize
from .o1.autocast import OpCasting, region
from .o1.autocast_kernels import install
from .o1.probes import PROBES, result_dtype
from .ops import supported_ops
from .step.loop import master_params, scale_loss, state
from .step.optimizer_state import optimizer_state
from .wrapping.wrap import wrap

__all__ = ["TorchAdapter", "TorchTrainer", "conformance_adapter"]


def _check_device(policy: Policy, device: str) -> None:
    cap = capabilities().device(device)
    needed = {policy.compute, policy.param}
    missing = sorted(d for d in needed if d != "auto" and d not in cap.compute_dtypes)
    if missing:
        raise UnsupportedDtypeError(
            f"{device} cannot compute in {', '.join(missing)} (it computes in "
            f"{', '.join(cap.compute_dtypes)}); choose a policy with another compute dtype"
        )


class TorchAdapter:
    """:class:`mixprec.testing.ConformanceAdapter` for PyTorch on the CPU."""

    name = "torch"
    device = "cpu"
    master_strategies = ("kahan", "stochastic")
    state_dtypes = ("bfloat16", *LOWBIT_FORMATS)

    def __init__(self) -> None:
        self._castings: dict[Policy, OpCasting] = {}

    def supported_ops(self) -> Collection[str]:
        """Every neutral family (see :data:`mixprec_torch.ops.TORCH_OPS`)."""
        return supported_ops()

    def op_dtype(self, policy: Policy, op: str, input_dtype: str) -> str:
        """The dtype ``op``'s first probe produces inside a wrapped forward under ``policy``,
        with every floating input (weights too) in ``input_dtype``."""
        _check_device(policy, self.device)
        casting = self._castings.get(policy)
        if casting is None:
            casting = self._castings[policy] = OpCasting(policy, (torch.device(self.device).type,))
            install(casting)
        n, run = PROBES[op][0]
        dtype = torch_dtype(input_dtype)
        with torch.no_grad(), region(casting):
            out = run((dtype,) * n, torch.device(self.device))
        return dtype_name(result_dtype(out))

    def make_trainer(self, policy: Policy, seed: int = 0) -> TorchTrainer:
        """A wrapped two-layer MLP with momentum SGD on a fixed batch."""
        return TorchTrainer(policy, seed, self.device)

    def fp8_quantise(
        self, recipe: str, fmt: str, rows: list[list[float]], scale: float | None
    ) -> tuple[list[list[float]], list[float]]:
        """``rows`` in ``fmt`` as the FP8 layers quantise an operand under ``recipe``."""
        x = torch.tensor(rows, dtype=torch.float32, device=self.device)
        delayed = None if scale is None else torch.tensor(scale, device=self.device)
        quantised = quantise(x, fmt, recipe, 1, delayed)
        scales = quantised.scale
        if recipe == "mxfp8":  # one per element, constant over each block: its first
            scales = scales[:, ::MX_BLOCK]
        return quantised.q.float().tolist(), scales.flatten().tolist()

    def lowbit_quantize(
        self, state: str, signed: bool, values: list[float]
    ) -> tuple[list[int], list[float], list[float]]:
        """``values`` encoded and decoded by the low-bit state's codec (:mod:`.lowbit.codec`)."""
        fmt = lowbit_format(state)
        x = torch.tensor(values, dtype=torch.float32, device=self.device)
        codes, absmax = lowbit_quantize(x, fmt, signed)
        decoded = dequantize(codes, absmax, fmt, signed, x.numel())
        return codes.tolist(), absmax.tolist(), decoded.tolist()


class TorchTrainer:
    """:class:`mixprec.testing.ConformanceTrainer` for PyTorch."""

    def __init__(self, policy: Policy, seed: int, device: str) -> None:
        _check_device(policy, device)
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        self.model, self.optimizer = wrap(model, optimizer, policy=policy)
        gen = torch.Generator().manual_seed(seed + 1)
        self.x = torch.randn(32, 6, generator=gen).to(device)
        self.y = torch.randn(32, 3, generator=gen).to(device)
        names = {id(p): n for n, p in self.model.named_parameters()}
        group = optimizer_state(self.optimizer).group
        self._masters = {names[id(p)]: m for p, m in group.masters.pairs if id(p) in names}
        self._compensation = group.compensation
        self._params = {names[id(p)]: p for p, _ in group.masters.pairs if id(p) in names}

    def step(self, inject_inf: bool = False) -> float:
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(self.x).float(), self.y)
        with scale_loss(loss, self.optimizer) as scaled:
            scaled.backward()
        if inject_inf:
            grad = next(p.grad for p in self.model.parameters() if p.grad is not None)
            grad.view(-1)[0] = float("inf")
        self.optimizer.step()
        return float(loss.detach())

    def params(self) -> dict[str, list[float]]:
        return {n: _values(p) for n, p in self.model.named_parameters()}

    def master_params(self) -> dict[str, list[float]]:
        if self._compensation is not None:  # the working masters exist only in step()
            best = {n: self._compensation.best(p) for n, p in self._params.items()}
            return {n: _values(b if b is not None else self._params[n]) for n, b in best.items()}
        return {n: _values(m) for n, m in self._masters.items()}

    def optimizer_state(self) -> dict[str, list[float]]:
        by_master = {id(m): n for n, m in self._masters.items()}
        out = {}
        for master in master_params(self.optimizer):
            for key, value in self.optimizer.state.get(master, {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"{by_master[id(master)]}.{key}"] = _values(value)
        return out

    def loss_scale(self) -> float:
        return float(state(self.optimizer).loss_scale)

    def skipped_steps(self) -> int:
        return int(state(self.optimizer).skipped_steps)

    def checkpoint(self) -> bytes:
        buffer = io.BytesIO()
        torch.save(
            {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, buffer
        )
        return buffer.getvalue()

    def restore(self, blob: bytes) -> None:
        saved = torch.load(io.BytesIO(blob), weights_only=True)
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])

    def saved_param_dtypes(self) -> set[str]:
        saved = torch.load(io.BytesIO(self.checkpoint()), weights_only=True)["model"]
        names = {n for n, _ in self.model.named_parameters()}
        return {dtype_name(v.dtype) for k, v in saved.items() if k in names}


def _values(tensor: torch.Tensor) -> list[float]:
    values: Any = tensor.detach().float().flatten().tolist()
    return list(values)


def conformance_adapter() -> TorchAdapter:
    """The adapter the conformance suite runs (``mixprec.torch.conformance_adapter()``)."""
    return TorchAdapter()
