"""What the Trainer holds, as the modules beneath it read it: names, masters, float32 values.

Data only (a typing :class:`TrainerState` protocol and pure functions of it): the step
(:mod:`~..stepping`), the checkpoints (:mod:`.checkpoint`) and export
(:mod:`~..wrapping.export`) read the Trainer through this module, so none of them imports
:mod:`~..trainer`, which imports them (the
torch backend's ``optimizer_state.py`` plays the same part).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import mxnet as mx
from mxnet import gluon, nd

from mixprec.kit import FLOAT32

from ..dtypes import cast
from ..gluon_private import params_with_prefix

if TYPE_CHECKING:
    from mixprec.kit import LossScaler, MasterWeights, Policy

    from ..compensated.compensation import Compensation

__all__ = ["TrainerState", "float32_value", "named_params", "names_by_id", "param_names"]


class TrainerState(Protocol):
    """The attributes of :class:`~mixprec_mxnet.trainer.Trainer` that the step, the
    checkpoints and export read (``gluon.Trainer``'s own and mixprec's)."""

    policy: Policy
    scaler: LossScaler
    masters: MasterWeights[gluon.Parameter] | None
    _net: gluon.Block | None
    _params: list[gluon.Parameter]
    _updaters: list[Any]
    _optimizer: Any
    _compensation: Compensation | None

    def _write_model(self, weight: nd.NDArray, data: nd.NDArray) -> None: ...


def named_params(trainer: TrainerState) -> dict[str, gluon.Parameter]:
    """The trainer's parameters by the names ``save_parameters`` writes (``"0.weight"``);
    by Gluon name when it was given parameters, not the net."""
    net = trainer._net
    if net is not None:
        return params_with_prefix(net)
    return {p.name: p for p in trainer._params}


def names_by_id(trainer: TrainerState) -> dict[int, str]:
    """``id(parameter)`` -> its name (a shared parameter keeps its first name)."""
    first: dict[int, str] = {}
    for name, param in named_params(trainer).items():
        first.setdefault(id(param), name)
    return first


def param_names(trainer: TrainerState) -> list[str]:
    """The name ``save_parameters`` keys each of the trainer's parameters by, in the
    trainer's index order."""
    names = names_by_id(trainer)
    return [names.get(id(p), p.name) for p in trainer._params]


def float32_value(trainer: TrainerState, param: gluon.Parameter) -> nd.NDArray:
    """``param``'s value in float32 on the CPU: its master's, or its own upcast exactly."""
    source = param if trainer.masters is None else trainer.masters.master_for(param)
    return cast(source.list_data()[0], FLOAT32).copyto(mx.cpu())
