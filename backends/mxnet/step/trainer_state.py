"""What mixprec keeps per Trainer: data only, as the torch backend's ``step/optimizer_state.py``.

:class:`TrainerState` is mixprec's part of one :class:`~mixprec_mxnet.trainer.Trainer`
(``trainer._mixprec``): the resolved policy, the loss scaler, the step tracker, the float32
masters, the ``grad_req='add'`` sums, BatchNorm's statistics, the compensated strategy, the
low-bit optimizer state, the overflow records, and what the construction's walk of the net
found. The work on it is the step's (:mod:`.protocol`), the masters' set-up
(:mod:`~..wrapping.masters`) and the Trainer's own; the checkpoints (:mod:`.checkpoint`,
:mod:`.states`) and export (:mod:`~..wrapping.export`) read it, so none of them imports the
Trainer, which imports them. ``gluon.Trainer``'s own state (the optimizer, its updaters, the
kvstore) stays on the Trainer, which the step is handed beside this.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import mxnet as mx
from mxnet import gluon, nd

from mixprec.kit import (
    BFLOAT16,
    FLOAT32,
    LossScaler,
    MasterWeights,
    OverflowRecord,
    Policy,
    StepTracker,
)

from ..blocks import BlockTree
from ..compensated.compensation import Compensation, StateRounding
from ..dtypes import cast
from ..gluon_private import params_with_prefix
from ..lowbit.state import LowBitState
from .accumulation import Accumulation
from .running_stats import RunningStats

__all__ = [
    "KEPT_OVERFLOWS",
    "TrainerState",
    "float32_value",
    "named_params",
    "names_by_id",
    "param_names",
    "state_rounding",
    "trainer_state",
]

#: How many skipped steps' overflow records a trainer keeps.
KEPT_OVERFLOWS = 100


def _overflow_log() -> deque[OverflowRecord]:
    return deque(maxlen=KEPT_OVERFLOWS)


@dataclasses.dataclass(eq=False)
class TrainerState:
    """mixprec's part of one Trainer (see the module docstring)."""

    policy: Policy
    """The resolved policy (saved with the trainer's states)."""
    device: str
    """The device key of the parameters' first context (``"cpu"``, ``"gpu"``)."""
    scaler: LossScaler
    """The loss-scale state and the step/skip counters."""
    seed: int
    """The seed of ``master=stochastic``'s random stream."""
    net: gluon.Block | None
    """The net the Trainer converted; None when it was given parameters."""
    tree: BlockTree | None
    """The construction's one walk of the net (None without a net)."""
    params: list[gluon.Parameter] = dataclasses.field(default_factory=list)
    """``gluon.Trainer``'s parameters, in its index order."""
    plan: list[tuple[gluon.Parameter, str]] = dataclasses.field(default_factory=list)
    """The dtype each parameter takes under the policy."""
    tracker: StepTracker = dataclasses.field(default_factory=StepTracker)
    accumulation: Accumulation = dataclasses.field(default_factory=Accumulation)
    """``grad_req='add'`` on low-precision parameters: the float32 sums in the masters."""
    running_stats: RunningStats | None = None
    """The net's BatchNorm statistics, put back on a skipped step (None without any)."""
    masters: MasterWeights[gluon.Parameter] | None = None
    """(model parameter, master parameter) pairs, once the parameters are initialised."""
    transient: bool = False
    """Whether the masters are float32 update copies of low-precision weights (no masters in
    the policy: O3, or a compensated strategy), reset to the rounded weights after a step."""
    compensation: Compensation | None = None
    """Under ``master=kahan|stochastic``: the strategy's buffers and its step passes."""
    lowbit: LowBitState | None = None
    """Under a low-bit ``state`` (``int8``, ``int4``, ``fp8``): the optimizer state's codes
    decoded around each update, and the checks and conversions of a load."""
    bf16_state: StateRounding | None = None
    """Under ``state="bfloat16"``: the compensated parameters' optimizer state widened around
    each update and rounded back stochastically (made with the strategy: :func:`state_rounding`)."""
    buffers: dict[int, list[nd.NDArray]] = dataclasses.field(default_factory=dict)
    """Per parameter id: the gradient buffers in the reduce dtype, where neither the model's
    nor the master's gradients have it."""
    reduced: bool = False
    """Whether this iteration's gradients are reduced into the masters already."""
    overflows: deque[OverflowRecord] = dataclasses.field(default_factory=_overflow_log)
    """The last :data:`KEPT_OVERFLOWS` skipped steps' overflow records, oldest first."""


def trainer_state(trainer: gluon.Trainer) -> TrainerState:
    """The mixprec state of a mixprec Trainer (``trainer._mixprec``)."""
    st: TrainerState = trainer._mixprec
    return st


def state_rounding(st: TrainerState) -> StateRounding | None:
    """Under ``state="bfloat16"``, once the masters (and with them the strategy) exist: the
    rounding of the compensated parameters' optimizer state; None otherwise."""
    comp = st.compensation
    if st.policy.state != BFLOAT16 or comp is None:
        return None
    rounding = st.bf16_state
    if rounding is None or rounding.compensation is not comp:
        index_of = {id(p): i for i, p in enumerate(st.params)}
        rounding = st.bf16_state = StateRounding(comp, index_of)
    return rounding


def named_params(st: TrainerState) -> dict[str, gluon.Parameter]:
    """The trainer's parameters by the names ``save_parameters`` writes (``"0.weight"``);
    by Gluon name when it was given parameters, not the net."""
    if st.net is not None:
        return params_with_prefix(st.net)
    return {p.name: p for p in st.params}


def names_by_id(st: TrainerState) -> dict[int, str]:
    """``id(parameter)`` -> its name (a shared parameter keeps its first name)."""
    first: dict[int, str] = {}
    for name, param in named_params(st).items():
        first.setdefault(id(param), name)
    return first


def param_names(st: TrainerState) -> list[str]:
    """The name ``save_parameters`` keys each of the trainer's parameters by, in the
    trainer's index order."""
    names = names_by_id(st)
    return [names.get(id(p), p.name) for p in st.params]


def float32_value(st: TrainerState, param: gluon.Parameter) -> nd.NDArray:
    """``param``'s value in float32 on the CPU: its master's, or its own upcast exactly."""
    source = param if st.masters is None else st.masters.master_for(param)
    return cast(source.list_data()[0], FLOAT32).copyto(mx.cpu())
