"""The loss-scale update as branch-free arithmetic, for steps compiled as pure functions.

:meth:`mixprec.DynamicScale.update` branches on Python values, which a compiled step
(``jax.jit``, ``torch.compile`` without graph breaks, ``jax.pmap``) cannot do: there
``found_inf`` and the running fields are arrays on the device. :func:`next_scale` is the
same state machine written with arithmetic, comparisons and one selection function
``where(condition, if_true, if_false)`` only, so a backend passes its framework's own
``where`` (``jax.numpy.where``) and gets a traceable update, while the core's tests run it
with :func:`python_where` and check it against ``DynamicScale.update`` step for step.

The running state is a :class:`ScaleState` of three values: the scale the next step uses,
the finite steps in a row since the last growth or overflow, and the overflows it still
takes to back off. :func:`initial_scale` reads them from a policy's loss-scale config and
:func:`scale_config_with` writes them back, for a checkpoint in the core's own format.

Two things the branching version does cannot happen inside a compiled step: raising at the
floor (``on_floor="raise"``: backends refuse it up front, :func:`check_traceable`) and the
floor's warning (the update returns a ``floor`` flag instead, for the backend to report).
The scale itself is whatever number type the backend stores: exact whenever ``init``,
``growth``, ``backoff``, ``min`` and ``max`` are powers of two (the defaults), as float32
holds every power of two the scale can reach.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from mixprec.errors import PolicyError
from mixprec.numerics.loss_scale import FLOAT32_MAX, DynamicScale, LossScaleConfig

__all__ = [
    "ScaleState",
    "ScaleUpdateArrays",
    "check_traceable",
    "initial_scale",
    "next_scale",
    "python_where",
    "scale_config_with",
]

T = TypeVar("T")

Where = Callable[[Any, Any, Any], Any]
"""``where(condition, if_true, if_false)``: elementwise selection (``jax.numpy.where``)."""


class ScaleState(NamedTuple):
    """The running fields of a loss scale, as values a compiled step carries."""

    scale: Any
    """The scale the next step multiplies the loss by (a float, or a float array)."""
    good_steps: Any
    """Finite steps in a row since the last growth or overflow (an int, or an int array)."""
    overflows_left: Any
    """Overflows it still takes to back off; 1 means the next one does."""


class ScaleUpdateArrays(NamedTuple):
    """What :func:`next_scale` returns: the next state and whether a backoff was clamped
    at ``min`` (where :meth:`DynamicScale.update` warns or raises)."""

    state: ScaleState
    floor: Any


def python_where(condition: object, if_true: T, if_false: T) -> T:
    """``where`` on plain Python values, for :func:`next_scale` outside a compiled step."""
    return if_true if condition else if_false


def initial_scale(config: LossScaleConfig) -> ScaleState:
    """The running fields of ``config`` as plain numbers (the scale 1.0 for ``NoScale``)."""
    if isinstance(config, DynamicScale):
        return ScaleState(config.scale, config.good_steps, config.overflows_left)
    return ScaleState(config.scale, 0, 1)


def scale_config_with(config: LossScaleConfig, state: ScaleState) -> LossScaleConfig:
    """``config`` carrying the running fields of ``state`` (read back from a device), as
    the core's loss-scale value: ``state_dict()`` of it is what checkpoints save.

    :raises PolicyError: the fields are outside what ``config`` allows.
    """
    if not isinstance(config, DynamicScale):
        return config
    return dataclasses.replace(
        config,
        scale=float(state.scale),
        good_steps=int(state.good_steps),
        overflows_left=int(state.overflows_left),
    )


def check_traceable(config: LossScaleConfig, backend: str) -> None:
    """Refuse what a compiled step cannot do: ``on_floor="raise"``.

    :raises PolicyError: naming the fix.
    """
    if isinstance(config, DynamicScale) and config.on_floor == "raise":
        raise PolicyError(
            f"the {backend} backend updates the loss scale inside the compiled step, which "
            "cannot raise when the scale hits its floor (on_floor='raise'); use "
            "on_floor='warn' (the step reports the floor in its info) or bfloat16 compute"
        )


def next_scale(
    config: LossScaleConfig, state: ScaleState, found_inf: Any, where: Where
) -> ScaleUpdateArrays:
    """The state after one step, the algorithm of :class:`~mixprec.DynamicScale` (see its
    docstring) without a branch on ``found_inf`` or the running fields.

    :param config: the policy's loss scale (its configuration fields are used; its running
        fields are ignored in favour of ``state``).
    :param state: the running fields now.
    :param found_inf: whether this step's gradients overflowed (a bool, or a bool array).
    :param where: the selection function of the values' framework.

    ``NoScale`` and ``StaticScale`` never change: their state comes back as it went in.
    """
    if not isinstance(config, DynamicScale):
        return ScaleUpdateArrays(state, where(found_inf, False, False))
    scale, good, left = state
    # a finite step: count it; the interval-th in a row grows the scale and refills
    counted = good + 1
    grow = counted >= config.interval
    grown = scale * config.growth
    grown = where(grown < config.max, grown, config.max)
    grown = where(grown > FLOAT32_MAX, scale, grown)  # past float32: stay
    finite_scale = where(grow, grown, scale)
    finite_good = where(grow, 0, counted)
    # refill="growth": a lone finite step keeps the tolerance; "finite": it refills it
    kept = left if config.refill == "growth" else config.hysteresis
    finite_left = where(grow, config.hysteresis, kept)
    # an overflow: tolerated while overflows are left, else back off (clamped at min)
    tolerated = left > 1
    target = scale * config.backoff
    clamped = target < config.min
    backed_off = where(clamped, config.min, target)
    overflow_scale = where(tolerated, scale, backed_off)
    overflow_left = where(tolerated, left - 1, 1)
    floor = where(found_inf, where(tolerated, False, clamped), False)
    return ScaleUpdateArrays(
        ScaleState(
            where(found_inf, overflow_scale, finite_scale),
            where(found_inf, 0, finite_good),
            where(found_inf, overflow_left, finite_left),
        ),
        floor,
    )
