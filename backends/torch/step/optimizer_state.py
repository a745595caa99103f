"""What mixprec keeps per wrap call and per optimizer: data only.

:class:`WrapGroup` is one ``wrap`` call: its policy, its one :class:`~mixprec.LossScaler`
and its :class:`~mixprec.masters.MasterWeights`, the one home of the (model parameter,
master) pairs. :class:`OptimizerState` is one optimizer of it (stored as
``optimizer._mixprec``), in three parts by lifetime:

- its :class:`Layout`: what is derived from the parameter groups (the model parameters and
  their separate masters as the fused copies take them, the guard pass's plan, whether the
  compensated fused update takes every parameter), built on first use and dropped whole when
  the groups change (``add_param_group``);
- its :class:`Iteration`: what the step in progress has found (the round's decision, the
  overflow flags, whether ``unscale_`` left the check to the step, ...), a fresh value from
  the end of one ``step()`` to the end of the next, replaced, never reset field by field;
- its history, on the state itself: the step tracker (its counters), the skip records and the
  master gradients' memory kept between steps. The loss scaler (the scale and the skip
  counters of the whole ``wrap`` call) is the group's.

:class:`Round` is the skip decision the optimizers of one backward pass share. The work on
them is :mod:`mixprec_torch.step.protocol`'s.
"""

from __future__ import annotations

import copy
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch

from mixprec.errors import WrapError
from mixprec.kit import LossScaler, MasterWeights, OverflowRecord, Policy, StepTracker

__all__ = [
    "Iteration",
    "Layout",
    "OptimizerState",
    "Round",
    "RoundGuard",
    "SpareGrad",
    "StepCompensation",
    "StepState",
    "WrapGroup",
    "base_class",
    "optimizer_state",
]


class StepCompensation(Protocol):
    """What the step and the checkpoints ask of a compensated strategy
    (:class:`mixprec_torch.compensated.compensation.Compensation`)."""

    def fusable_params(self, optimizer: torch.optim.Optimizer) -> bool: ...
    def fusable_options(self, optimizer: torch.optim.Optimizer) -> bool: ...
    def step_fused(self, optimizer: torch.optim.Optimizer, *, master_grads: bool) -> None: ...
    def fill(self, optimizer: torch.optim.Optimizer) -> None: ...
    def store(self, optimizer: torch.optim.Optimizer) -> None: ...
    def materialize(self) -> None: ...
    def assign(self, param: torch.Tensor, value: torch.Tensor) -> bool: ...
    def adopt_state(self, optimizer: torch.optim.Optimizer) -> None: ...
    def best(self, param: torch.Tensor) -> torch.Tensor | None: ...
    def split_loaded(self, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor | None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def check_state_dict(self, sd: Any) -> None: ...
    def load_state_dict(self, sd: dict[str, Any]) -> None: ...


class StepLowBit(Protocol):
    """What the step and the checkpoints ask of a low-bit optimizer state
    (:class:`mixprec_torch.lowbit.state.LowBitState`)."""

    def widen(self, optimizer: torch.optim.Optimizer) -> None: ...
    def narrow(self, optimizer: torch.optim.Optimizer) -> None: ...
    def step_fused(self, optimizer: torch.optim.Optimizer) -> bool: ...
    def check_state_dict(
        self, optimizer: torch.optim.Optimizer, state: Any, groups: Any = None
    ) -> None: ...
    def adopt(self, optimizer: torch.optim.Optimizer) -> None: ...


class StepState(Protocol):
    """State a step changes that checkpoints carry in the optimizer's state dict."""

    def state_dict(self) -> dict[str, Any]: ...
    def check_state_dict(self, sd: Any) -> None: ...
    def load_state_dict(self, sd: Any) -> None: ...


SpareGrad = tuple[torch.UntypedStorage, torch.dtype, int, tuple[int, ...], tuple[int, ...]]
"""A gradient's memory without the tensor: (storage, dtype, storage offset, shape, strides)."""


class RoundGuard(Protocol):
    """Something a step changes besides the optimizer's parameters and state, per model.

    ``scope`` is the indices (in the ``wrap`` call) of the models the round's optimizers
    train, plus every model no optimizer trains (:meth:`WrapGroup.scope`).
    """

    def flag(self, scope: frozenset[int]) -> torch.Tensor | None:
        """A device-side flag, nonzero when this step left a non-finite value in the models
        of ``scope`` (no host sync)."""
        ...

    def settle(self, skipped: bool, scope: frozenset[int]) -> None:
        """The round's decision: undo this step's changes to the models of ``scope`` when
        ``skipped``."""
        ...


class Round:
    """One skip-or-step decision, shared by the optimizers unscaled for it."""

    __slots__ = ("skipped",)

    def __init__(self, skipped: bool) -> None:
        self.skipped = skipped


class WrapGroup:
    """The optimizers (and models) of one ``wrap`` call: one loss scaler, one policy, one
    master map."""

    def __init__(
        self,
        policy: Policy,
        scaler: LossScaler,
        device: str,
        masters: MasterWeights[torch.Tensor],
        names: dict[int, str],
    ) -> None:
        self.policy = policy
        self.scaler = scaler
        self.device = device
        self.masters = masters
        """Every model parameter's master (the parameter itself where no copy is kept)."""
        self.names = names
        """id(model param) -> its qualified name, every parameter of the wrapped models."""
        self.states: list[weakref.ReferenceType[OptimizerState]] = []
        self.skip_each = getattr(policy.loss_scale, "skip", "group") == "optimizer"
        """Each optimizer of a round skips only on its own overflow (``skip="optimizer"``)."""
        self.compensation: StepCompensation | None = None
        """Under ``master=kahan|stochastic``: the strategy's buffers and its step passes."""
        self.lowbit: StepLowBit | None = None
        """Under ``state=int8|int4|fp8``: the quantized optimizer state's codec."""
        self.fp8: StepState | None = None
        """Under ``fp8``: the FP8 layers and the delayed recipe's state
        (:class:`mixprec_torch.fp8.layers.FP8Layers`)."""
        self.round_guards: list[RoundGuard] = []
        """State beyond the optimizer that a step changes (BatchNorm running statistics):
        checked with the gradients, put back when the round is skipped."""
        self.param_versions: dict[int, int] = {}
        """id(model param) -> its version counter once ``wrap`` cast it; a different counter
        before the first step means the user edited it (:mod:`.model_edits`)."""
        self.param_models: dict[int, int] = {}
        """id(model param) -> the index of its model in the ``wrap`` call."""
        self.model_count = 0
        """How many models the ``wrap`` call converted."""

    def __deepcopy__(self, memo: dict[int, Any]) -> WrapGroup:
        """A copy for a copied model: its own scaler and master map, and no optimizers (the
        original's optimizers step the original's masters, never the copy's)."""
        new: WrapGroup = object.__new__(type(self))
        memo[id(self)] = new
        fields = {k: v for k, v in self.__dict__.items() if k != "states"}
        new.__dict__.update(copy.deepcopy(fields, memo))
        new.states = []
        return new

    def live_states(self) -> list[OptimizerState]:
        """The optimizer states of this group whose optimizers still exist."""
        alive = [s() for s in self.states]
        return [s for s in alive if s is not None]

    def scope(
        self, members: list[OptimizerState], live: list[OptimizerState] | None = None
    ) -> frozenset[int]:
        """The models a round of ``members`` settles: those they train, and every model no
        optimizer of the group trains (a frozen model in training mode). ``live``: the
        group's :meth:`live_states`, when the caller has them."""
        live = self.live_states() if live is None else live
        trained = frozenset().union(*(st.models for st in live))
        untrained = frozenset(range(self.model_count)) - trained
        return untrained.union(*(st.models for st in members))


class Layout:
    """What the step derives from the optimizer's parameter groups: built on first use
    (:func:`mixprec_torch.step.protocol.layout`), replaced whole when the groups change."""

    __slots__ = (
        "foreach_sgd",
        "fusable",
        "guard_plan",
        "masters",
        "model_of",
        "pairs",
        "params",
        "versions",
    )

    def __init__(self, params: list[torch.Tensor], masters: list[torch.Tensor]) -> None:
        self.params = params
        """The model parameters with a separate master among the optimizer's, in its order."""
        self.masters = masters
        """Their masters (the tensors the optimizer holds), in the same order."""
        self.pairs = (params, masters)
        """The two lists as the fused copies take them (one tuple, kept: its identity keys
        the guard plan)."""
        self.model_of = {id(m): p for p, m in zip(params, masters, strict=True)}
        """id(master) -> its model parameter."""
        self.guard_plan: Any = None
        """The native guard pass's view of the optimizer's tensors
        (:class:`mixprec_torch.cpu.grad_check.GuardPlan`), built on the first native pass."""
        self.fusable: bool | None = None
        """Under ``master=kahan|stochastic``: every parameter can take the fused update (its
        weight a contiguous CPU tensor the strategy handles, or a float32 CPU one); decided
        once per layout (the groups' options are checked at each use: a compiled step may
        change them). None: not decided yet."""
        self.foreach_sgd: int | None = None
        """A ``torch.optim.SGD`` over float32/float64 CPU tensors: their element count, the
        foreach update's bits being the for-loop's (:mod:`.master_update`); 0: another
        optimizer. None: not decided yet."""
        self.versions: list[int] | None = None
        """The version counters of :attr:`params` after the last master copy; None until the
        first step of this layout (:mod:`.model_edits`)."""


class Iteration:
    """What one step of an optimizer has found so far: created when the previous ``step()``
    ends (or at wrap, or when a checkpoint is loaded), filled by ``unscale_``, the round and
    the step, and replaced by a fresh one when this ``step()`` ends, taken or skipped."""

    __slots__ = (
        "checked",
        "dense_grads",
        "found_inf",
        "found_on_host",
        "grad_marks",
        "grads_cast",
        "implicit_unscale",
        "reevaluating",
        "round",
        "unchecked",
    )

    def __init__(self) -> None:
        self.round: Round | None = None
        """The decision of the round this optimizer was unscaled for, once a ``step()`` of
        the group opened it."""
        self.found_inf: list[torch.Tensor] = []
        """The device-side overflow flags of the latest unscale (one per device)."""
        self.found_on_host: bool | None = None
        """The native guard pass's verdict, on the host already (True: an overflow); None
        where no native pass ran since the flags were last taken."""
        self.unchecked = False
        """The gradients were unscaled without the guard's check (``unscale_``): the step
        checks them, after whatever the user did to them since."""
        self.implicit_unscale = False
        """Another optimizer's ``step()`` unscaled this one (so ``unscale_`` is a no-op)."""
        self.checked: tuple[list[torch.Tensor], list[int]] | None = None
        """Checked when another optimizer's ``step()`` opened the round: the gradients and
        their version counters then, so its own step notices a write in between."""
        self.grad_marks: tuple[list[torch.Tensor | None], list[int]] | None = None
        """After ``unscale_``: the model gradients and their version counters, to notice a
        clip of the model's gradients before the check (:mod:`.model_edits`)."""
        self.dense_grads = False
        """The guard's latest check read every gradient the optimizer applies, and none was
        sparse (torch's foreach SGD may take them: :mod:`.master_update`)."""
        self.grads_cast = False
        """This step's gradients were cast into the masters' ``.grad`` (False: under the
        fused compensated update the model's own gradients are read instead)."""
        self.reevaluating = False
        """The optimizer's own ``step()`` is re-running its closure (LBFGS's line search): a
        ``scale_loss`` inside belongs to that step."""


class OptimizerState:
    """What mixprec keeps per optimizer (stored as ``optimizer._mixprec``): which optimizer
    and group, its :class:`Layout`, its :class:`Iteration` and its history."""

    __slots__ = (
        "__weakref__",
        "drop_master_grads",
        "group",
        "iteration",
        "layout",
        "local",
        "models",
        "models_checked",
        "optimizer",
        "overflows",
        "own_skip_at",
        "own_skips",
        "spare_grads",
        "tracker",
    )

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        group: WrapGroup,
        *,
        local: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.optimizer: Callable[[], torch.optim.Optimizer | None] = weakref.ref(optimizer)
        self.group = group
        self.local = local
        """Maps a gradient to the part this rank holds (DTensor shards under FSDP2)."""
        self.models: frozenset[int] = frozenset()
        """The indices of the models (of the ``wrap`` call) whose parameters it updates."""
        self.models_checked = False
        """The first step found the models holding the parameters ``wrap`` converted (a
        plain flag, so a compiled step reads it without tracing the check)."""
        self.drop_master_grads = False
        """After every step, taken or skipped, the separate masters' gradients are dropped
        (the apex shim: apex cleared them so, as ``model.zero_grad()`` cannot reach them)."""
        self.layout: Layout | None = None
        """Derived from the parameter groups; None until first used and whenever the groups
        change."""
        self.iteration = Iteration()
        """The step in progress."""
        # history: what lives from step to step
        self.tracker = StepTracker()
        """The stage of the iteration and the count of completed steps."""
        self.overflows: deque[OverflowRecord] = deque(maxlen=100)
        """The parameters that overflowed, per skipped step (filled only on a skip)."""
        self.own_skips = 0
        """Steps this optimizer skipped alone: a member of a round whose gradients were
        written after the round's check and overflow (the round did not skip)."""
        self.own_skip_at = -1
        """The group scaler's step count at the latest of them (-1: none): while it is the
        count, the latest step of this optimizer was skipped."""
        self.spare_grads: dict[int, SpareGrad] = {}
        """id(master) -> the float32 gradient memory ``zero_grad(set_to_none=True)`` took
        off that master, reused by the next cast into it (:mod:`.model_edits`) instead of
        allocating (and, on the CPU, page-faulting) the buffer again every step."""


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
