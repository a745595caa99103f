"""What mixprec keeps per wrap call and per optimizer, and the gradient work on it.

:class:`WrapGroup` is one ``wrap`` call: its policy, its one :class:`~mixprec.LossScaler`
and the (model parameter, master) pairs. :class:`OptimizerState` is one optimizer of it
(stored as ``optimizer._mixprec``): its step tracker, its copied masters and the two
gradient passes of a step, copying model gradients into the masters and the fused
unscale-and-check. :class:`Round` is the skip decision the optimizers of one backward pass
share (see :mod:`mixprec_torch.optimizer` for how rounds work).
"""

from __future__ import annotations

import weakref
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from typing import Any

import torch

from mixprec.diagnostics import OverflowRecord
from mixprec.errors import WrapError
from mixprec.policy import Policy
from mixprec.scaler import LossScaler
from mixprec.step import StepTracker

__all__ = ["OptimizerState", "Round", "WrapGroup", "optimizer_state"]


class Round:
    """One skip-or-step decision, shared by the optimizers unscaled for it."""

    __slots__ = ("skipped",)

    def __init__(self, skipped: bool) -> None:
        self.skipped = skipped


class WrapGroup:
    """The optimizers (and models) of one ``wrap`` call: one loss scaler, one policy."""

    def __init__(self, policy: Policy, scaler: LossScaler, device: str) -> None:
        self.policy = policy
        self.scaler = scaler
        self.device = device
        self.states: list[weakref.ReferenceType[OptimizerState]] = []
        self.masters: dict[int, torch.Tensor] = {}
        """id(model param) -> its master (the param itself where no copy is kept)."""
        self.model_params: dict[int, torch.nn.Parameter] = {}
        """id(model param) -> model param, every parameter of the wrapped models."""
        self.names: dict[int, str] = {}
        """id(model param) -> its qualified name, for diagnostics."""

    def live_states(self) -> list[OptimizerState]:
        """The optimizer states of this group whose optimizers still exist."""
        alive = [s() for s in self.states]
        return [s for s in alive if s is not None]


class OptimizerState:
    """What mixprec keeps per optimizer (stored as ``optimizer._mixprec``)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        group: WrapGroup,
        *,
        local: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.optimizer: Callable[[], torch.optim.Optimizer | None] = weakref.ref(optimizer)
        self.group = group
        self.tracker = StepTracker()
        self.copied: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        """(model param, master) pairs whose master is a separate float32 copy; grown only
        by :meth:`masters_for`."""
        self._copied_ids: set[int] = set()
        self._copy_lists: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self.local = local
        """Maps a gradient to the part this rank holds (DTensor shards under FSDP2)."""
        self.found_inf: list[torch.Tensor] = []
        self.round: Round | None = None
        self.implicit_unscale = False
        self.overflows: deque[OverflowRecord] = deque(maxlen=100)
        """The parameters that overflowed, per skipped step (filled only on a skip)."""

    # ------------------------------------------------------------------ masters

    def masters_for(self, params: Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
        """The masters the optimizer holds for these model parameters (one per unique master);
        records the pairs whose master is a separate copy in :attr:`copied`."""
        masters = []
        for param in params:
            master = self.group.masters[id(param)]
            if master is not param and id(master) not in self._copied_ids:
                self._copied_ids.add(id(master))
                self.copied.append((param, master))
                self._copy_lists = None
            masters.append(master)
        return masters

    def copy_masters_to_model(self) -> None:
        """Copy every separate master into its model parameter (one fused foreach copy).

        The two tensor lists are built once and reused every step until :meth:`masters_for`
        adds a pair.
        """
        if not self.copied:
            return
        if self._copy_lists is None:
            self._copy_lists = ([p for p, _ in self.copied], [m for _, m in self.copied])
        with torch.no_grad():
            torch._foreach_copy_(*self._copy_lists)

    # ------------------------------------------------------------------ gradients

    def copy_grads_to_masters(self) -> None:
        """Cast the model gradients into the masters' float32 gradients (None stays None)."""
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for param, master in self.copied:
            grad = param.grad
            if grad is None:
                master.grad = None
                continue
            if grad.is_sparse:
                master.grad = grad.to(master.dtype)
                continue
            if master.grad is None or master.grad.shape != master.shape:
                master.grad = torch.empty_like(master)
            dst.append(master.grad)
            src.append(grad)
        if dst:
            with torch.no_grad():
                torch._foreach_copy_(dst, src)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale the gradients the optimizer will apply, in place, and record overflow.

        One fused ``_amp_foreach_non_finite_check_and_unscale_`` per (device, dtype); the
        overflow flags stay on the device (no host sync here).
        """
        self.copy_grads_to_masters()
        scaler = self.group.scaler
        by_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
            lambda: defaultdict(list)
        )
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None:
                        continue
                    if self.local is not None:
                        grad = self.local(grad)
                    if grad.is_sparse:
                        if grad.dtype is torch.float16:
                            param.grad = grad = grad.coalesce()
                        grad = grad._values()
                    by_device[grad.device][grad.dtype].append(grad)
            inv = 1.0 / scaler.scale if scaler.enabled else 1.0
            found_list = []
            for device, per_dtype in by_device.items():
                found = torch.zeros(1, dtype=torch.float32, device=device)
                inv_scale = torch.full((), inv, dtype=torch.float32, device=device)
                for grads in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale)
                found_list.append(found)
        self.found_inf = found_list


def base_class(optimizer: torch.optim.Optimizer) -> type[torch.optim.Optimizer]:
    """The optimizer's own class, beneath the subclass ``wrap`` swapped in (see optimizer.py)."""
    base: type[torch.optim.Optimizer] = type(optimizer)._mixprec_base  # type: ignore[attr-defined]
    return base


def optimizer_state(optimizer: Any, what: str = "this call") -> OptimizerState:
    """The mixprec state of a wrapped optimizer; WrapError naming the fix otherwise."""
    st = getattr(optimizer, "_mixprec", None)
    if not isinstance(st, OptimizerState):
        raise WrapError(
            f"{what} needs an optimizer wrapped by mixprec.torch.wrap, got "
            f"{type(optimizer).__name__}; wrap it first: "
            "model, optimizer = mixprec.torch.wrap(model, optimizer, policy=...)"
        )
    return st
