"""Compensated bfloat16 weights, the readable reference of the arithmetic.

The policy's ``master`` may be ``"kahan"`` or ``"stochastic"`` instead of a dtype
(:mod:`mixprec.compensated` describes both). Neither keeps a float32 copy of the weights
between steps: a step builds a float32 *working* value per parameter, lets the unchanged
optimizer update it in float32, and stores the result back into the bfloat16 weight:

- ``kahan``: working value ``w + c``; after the update ``w = nearest(v)`` and
  ``c = nearest(v - w)``, so the rounding error is carried, not lost;
- ``stochastic``: working value ``w``; after the update ``w = stochastic(v)``, drawn from a
  seeded NumPy generator whose state is part of the checkpoint.

Under ``state="bfloat16"`` (either strategy) the optimizer's state of the compensated
parameters (each floating array of the parameter's shape in ``optimizer.state``) is kept on
the bfloat16 grid between steps: the optimizer updates it in float32 (widening a bfloat16
value is exact, so there is nothing to do before the update), and after the weights it is
stored as ``s = stochastic(s')`` from the same generator, in parameter order. Stochastic,
not nearest: Adam's ``v`` moves by less than half a bfloat16 spacing per step once it is
near ``g**2``, and nearest rounding would freeze it there (:mod:`mixprec.compensated`).

Each function below is one line of that arithmetic, so a backend author can check theirs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from mixprec.errors import CheckpointError
from mixprec.kit import KAHAN, STOCHASTIC
from mixprec_numpy.casting import Array, float32, round_to_bfloat16
from mixprec_numpy.layers import Parameter

__all__ = ["Compensation", "kahan_split", "round_state", "round_stochastic_to_bfloat16"]


class _Updates(Protocol):
    @property
    def state(self) -> dict[str, Array]: ...

    def update(self, params: list[Parameter]) -> None: ...


def round_stochastic_to_bfloat16(x: Array, rng: np.random.Generator) -> Array:
    """``x`` rounded to one of its two bfloat16 neighbours, the farther one with probability
    equal to the distance from the nearer-to-zero one in units of their spacing.

    In bits: add a uniform integer in ``[0, 2**16)`` to the low 16 bits of the float32
    pattern (a carry moves to the next bfloat16 value), then clear them. Unbiased:
    the expected result is ``x``. NaNs stay NaN.
    """
    x = np.asarray(x, dtype=np.float32)
    bits = np.atleast_1d(x).view(np.uint32)
    noise = rng.integers(0, 1 << 16, size=bits.shape, dtype=np.uint32)
    rounded = ((bits + noise) & np.uint32(0xFFFF0000)).view(np.float32)
    return np.where(np.isnan(x), x, rounded.reshape(x.shape))


def round_state(
    state: dict[str, Array], params: Sequence[Parameter], rng: np.random.Generator
) -> None:
    """``state="bfloat16"``: round each parameter's state array of its shape (the
    optimizer's ``state`` by parameter name) stochastically onto the bfloat16 grid."""
    for p in params:
        value = state.get(p.name)
        if value is not None and np.shape(value) == np.shape(p.data):
            state[p.name] = round_stochastic_to_bfloat16(value, rng)


def kahan_split(value: Array) -> tuple[Array, Array]:
    """The bfloat16 weight and compensation that together hold the float32 ``value``:
    ``w = nearest(value)``, ``c = nearest(value - w)`` (both stored as float32 arrays)."""
    weight = round_to_bfloat16(value)
    return weight, round_to_bfloat16(float32(value) - weight)


class Compensation:
    """The state a strategy keeps beside the bfloat16 weights, and its step.

    :param params: the parameters the optimizer updates (bfloat16 ones are compensated;
        float32 ones, such as pinned modules, are updated as they are).
    :param strategy: ``"kahan"`` or ``"stochastic"``.
    :param seed: seeds the stochastic rounding's random stream.
    :param state: the policy's ``state``: ``"bfloat16"`` keeps the optimizer's state of the
        compensated parameters on the bfloat16 grid between steps (a low-bit format is
        :mod:`mixprec_numpy.lowbit`'s business: the optimizer passed to :meth:`update` is
        then its :class:`~mixprec_numpy.lowbit.LowBitState`).
    """

    def __init__(
        self,
        params: Sequence[Parameter],
        strategy: str,
        seed: int = 0,
        state: str | None = None,
    ) -> None:
        self.strategy = strategy
        self.state = state
        self.params = [p for p in params if p.dtype == "bfloat16"]
        #: ``kahan``: each compensated parameter's compensation ``c``, by name.
        self.buffers: dict[str, Array] = (
            {p.name: np.zeros_like(p.data) for p in self.params} if strategy == KAHAN else {}
        )
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def best(self, param: Parameter) -> Array:
        """The float32 value the strategy knows for ``param``: ``w + c`` under ``kahan``."""
        if param.name in self.buffers:
            return float32(param.data) + self.buffers[param.name]
        return float32(param.data).copy()

    def update(self, optimizer: _Updates, params: Sequence[Parameter]) -> None:
        """One optimizer step on float32 working values, stored back into bfloat16."""
        compensated = {p.name for p in self.params}
        working = []
        for p in params:
            if p.name not in compensated:
                working.append(p)  # a float32 parameter is its own working value
                continue
            grad = None if p.grad is None else float32(p.grad)
            working.append(Parameter(p.name, self.best(p), "float32", grad, p.module_class))
        optimizer.update(working)
        for p, w in zip(params, working, strict=True):
            if p.name not in compensated:
                continue
            if self.strategy == STOCHASTIC:
                p.data = round_stochastic_to_bfloat16(w.data, self.rng)
            else:
                p.data, self.buffers[p.name] = kahan_split(w.data)
        if self.state == "bfloat16":  # after the weights: the same stream, in parameter order
            round_state(optimizer.state, self.params, self.rng)

    def check_restore(self, param: Parameter, saved: Array, compensation: Array | None) -> None:
        """Raise :class:`~mixprec.errors.CheckpointError` where :meth:`restore` would."""
        if self.strategy == KAHAN and param.name in self.buffers:
            if compensation is None or compensation.shape != saved.shape:
                raise CheckpointError(
                    f"the checkpoint has no Kahan compensation for {param.name!r}; it was not "
                    "saved under master=kahan"
                )

    def check_rng_state(self, state: Any) -> None:
        """Raise :class:`~mixprec.errors.CheckpointError` unless ``state`` is a random stream
        state this trainer's generator takes."""
        try:
            np.random.PCG64().state = dict(state)  # type: ignore[assignment]
        except (TypeError, ValueError, KeyError) as err:
            raise CheckpointError(
                f"the checkpoint's random stream state is malformed ({err}); pass a file "
                "that Trainer.save wrote"
            ) from err

    def restore(self, param: Parameter, saved: Array, compensation: Array | None) -> None:
        """Set ``param`` from a checkpoint's float32 ``saved = w + c`` and the exact ``c``:
        ``w = nearest(saved - c)`` is the weight that was saved, bit for bit (the float32
        sum is off from ``w + c`` by far less than half a bfloat16 step)."""
        if self.strategy == KAHAN and param.name in self.buffers:
            if compensation is None or compensation.shape != saved.shape:
                raise CheckpointError(
                    f"the checkpoint has no Kahan compensation for {param.name!r}; it was not "
                    "saved under master=kahan"
                )
            self.buffers[param.name] = np.array(compensation, np.float32)
            param.data = round_to_bfloat16(float32(saved) - self.buffers[param.name])
        else:
            param.data = round_to_bfloat16(saved) if param.dtype == "bfloat16" else saved

    def state_dict(self) -> tuple[dict[str, Array], dict[str, Any]]:
        """(compensation arrays by name, the random stream's state as JSON-able data)."""
        return {n: c.copy() for n, c in self.buffers.items()}, dict(self.rng.bit_generator.state)

    def load_rng_state(self, state: Mapping[str, Any]) -> None:
        """Continue the random stream where the checkpoint left it."""
        self.rng.bit_generator.state = dict(state)
