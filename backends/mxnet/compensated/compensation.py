"""Compensated bfloat16 weights (``master=kahan|stochastic``) around the MXNet optimizer.

The arithmetic is :mod:`mixprec.compensated`'s (the NumPy plugin's
``mixprec_numpy.compensation`` is its readable reference). The Gluon form keeps the
optimizer unchanged and its update in float32, on the float32 *working* masters the Trainer
already keeps for bfloat16 weights (MXNet has no bfloat16 optimizer kernel, so under
O3-bf16 too the update runs on float32 copies):

- :meth:`Compensation.fill`, before the update, writes ``w + c`` (kahan) or ``w``
  (stochastic) into the working masters: ``amp_cast`` of the weight plus the compensation,
  one elementwise op per array;
- after the update, :meth:`Compensation.store` puts the float32 result ``v`` back. Kahan:
  ``w = nearest(v)`` (``amp_cast`` rounds to nearest-even; ``astype`` would truncate),
  ``c = nearest(v - w)``, and the working master keeps ``w + c``, the best value known, so
  ``net.save_parameters`` saves it. Stochastic: a uniform integer in ``[0, 2**16)`` is added
  to the low 16 bits of each float32 bit pattern, which are then cleared, and the result
  (exact in bfloat16) is cast into the weight. MXNet 1.9 has no bit cast for NDArrays, so
  this runs on the host in NumPy, one vectorised pass per parameter (a copy out and a copy
  back; on CPU contexts that is memory traffic, not a device transfer). The noise comes
  from a NumPy ``PCG64`` generator seeded by the Trainer's ``seed`` and drawn per
  parameter in the net's order (the order ``save_parameters`` lists them), as the NumPy
  reference draws it; every context of a parameter gets the same noise, so replicas stay
  equal.

Between steps the working masters stay allocated (as under O3-bf16 on Gluon), so the
memory saved against O2-bf16 is nil here: what the strategy buys on Gluon is O2's accuracy
with bfloat16 weights in the forward pass, and 2 more bytes per parameter (the bfloat16
compensation) under kahan. With ``state="bfloat16"`` (below) the optimizer state of the
compensated parameters takes half its float32 bytes between steps: Adam's 8 bytes per
parameter become 4, a momentum's 4 become 2.

Checkpoints: ``save_parameters`` writes the working master, ``w + c`` in float32;
``save_states`` adds :meth:`Compensation.state_dict` (the exact compensation and the
generator state). Loading parameters splits each saved value into ``w, c``
(:meth:`Compensation.split`); loading the states afterwards puts back the saved ``c`` and
re-derives ``w = nearest(saved - c)``, the weight that was saved, bit for bit.

Optimizer state in bfloat16 (``state="bfloat16"``, :class:`StateRounding`). Under either
strategy the policy may keep the optimizer's per-parameter state of the compensated
parameters on the bfloat16 grid between steps (the NumPy reference's ``round_state``); the
optimizer is unchanged and updates its state in float32, as it updates the working masters:

- the *state arrays* are, in each context's ``updater.states[index]`` (an array, or a tuple
  or list of them, as the optimizer made it), every dense float32 NDArray of the parameter's
  shape: SGD's and NAG's momentum, the mean and variance of Adam, AdamW and LAMB, any other
  optimizer's moments alike; never anything of another shape or dtype. The compensated
  parameters are the strategy's (:func:`compensated_pairs`): a parameter the
  policy keeps in float32 keeps its float32 state;
- between steps each of them is a **bfloat16 NDArray** on the weight's context (2 bytes an
  element where the optimizer keeps 4); :meth:`StateRounding.widen`, before an updater's
  update, puts float32 copies in their place (``Cast``: widening is exact), so Gluon's
  updater and the multi-tensor kernels see the float32 state they made;
- :meth:`StateRounding.narrow`, after every context's update and after the weights (the
  strategy's :meth:`Compensation.store`), rounds each float32 state array
  stochastically onto the bfloat16 grid (:func:`round_stochastic`) and puts
  the result back as a bfloat16 NDArray. The noise is the strategy's generator's (the NumPy
  ``PCG64`` seeded by the Trainer's ``seed``), drawn after the weights' noise, parameter by
  parameter in the net's order and, within one parameter, state array by state array in the
  optimizer's order (Adam: the mean, then the variance), one draw of the parameter's shape
  each, shared by every context (replicas stay equal). Under kahan the weights draw nothing,
  so the state's draws are the only ones. This is the NumPy reference's order: its
  ``Compensation.update`` rounds the weights, then ``round_state``.

Stochastic, not nearest, under both strategies: Adam's variance moves by less than half a
bfloat16 spacing per step once it is near ``g**2``, and nearest rounding would freeze it.
A skipped step reaches neither pass: the bfloat16 state stays bit for bit and no noise is
drawn (the reference does not update on a skip either). A step interrupted between the two
passes leaves float32 state behind, which the next step's :meth:`~StateRounding.narrow`
rounds like a fresh one.

Checkpoints: ``save_states`` writes the bfloat16 arrays as they are (``nd.save`` keeps the
dtype), and with the generator's state (:mod:`~..step.states`) a resume repeats the
trajectory bit for bit. :meth:`StateRounding.adopt` brings a loaded state into this form: a
float32 state (a file saved without ``state=bfloat16``, or by ``gluon.Trainer``) is rounded
to the nearest bfloat16 value (once, drawing no noise, so the saved random stream stays
where it was), bfloat16 arrays stay; a Trainer without ``state=bfloat16`` widens the
bfloat16 arrays of a file exactly (:func:`widened`: the way back to float32).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import mxnet as mx
import numpy as np
import numpy.typing as npt
from mxnet import gluon, nd

from mixprec.errors import CheckpointError
from mixprec.kit import BFLOAT16, FLOAT32, KAHAN

from ..dtypes import BFLOAT16_NP, cast, cast_into, dtype_name, map_arrays

__all__ = [
    "Compensation",
    "StateRounding",
    "compensated_pairs",
    "is_bfloat16",
    "round_stochastic",
    "widened",
]

_LOW_MASK = np.uint32(0xFFFF0000)
Float32Array = npt.NDArray[np.float32]


def round_stochastic(values: Float32Array, noise: npt.NDArray[np.uint32]) -> Float32Array:
    """float32 ``values`` rounded onto the bfloat16 grid with the 16-bit integer ``noise``
    (the NumPy reference's ``round_stochastic_to_bfloat16``, noise given); NaNs stay NaN."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + noise.reshape(bits.shape)) & _LOW_MASK).view(np.float32)
    return np.where(np.isnan(values), values, rounded)


class Compensation:
    """The kahan or stochastic state of one Trainer, and its passes around each update.

    :param pairs: (bfloat16 model parameter, its float32 working master) for every
        compensated parameter, in the order the random stream is drawn in. The masters must
        hold the exact float32 values from before the parameters were cast: under kahan the
        initial compensation keeps what bfloat16 drops of them.
    :param strategy: ``"kahan"`` or ``"stochastic"``.
    :param seed: seeds the stochastic rounding's random stream.
    """

    def __init__(
        self,
        pairs: Sequence[tuple[gluon.Parameter, gluon.Parameter]],
        strategy: str,
        seed: int = 0,
    ) -> None:
        self.strategy = strategy
        self.pairs = list(pairs)
        self.rng = np.random.Generator(np.random.PCG64(seed))
        #: id(working master array) -> (index of its pair, the compensation on its context)
        self._arrays: dict[int, tuple[int, nd.NDArray | None]] = {}
        for index, (param, master) in enumerate(self.pairs):
            for data, weight in zip(param.list_data(), master.list_data(), strict=True):
                comp = None
                if strategy == KAHAN:
                    comp = nd.zeros(data.shape, data.context, dtype=data.dtype)
                self._arrays[id(weight)] = (index, comp)
        for data, weight in self._contexts():
            self.split(weight, data)  # w = nearest(v), c = nearest(v - w)

    def handles(self, weight: nd.NDArray) -> bool:
        """Whether ``weight`` is one of the working masters this strategy keeps."""
        return id(weight) in self._arrays

    def _comp(self, weight: nd.NDArray) -> nd.NDArray | None:
        return self._arrays[id(weight)][1]

    def _contexts(self) -> list[tuple[nd.NDArray, nd.NDArray]]:
        """(model data, working master) for every compensated parameter and context."""
        return [
            (data, weight)
            for param, master in self.pairs
            for data, weight in zip(param.list_data(), master.list_data(), strict=True)
        ]

    # ------------------------------------------------------------------ the step

    def fill(self) -> None:
        """Write ``w + c`` (kahan) or ``w`` into the working masters, before the update."""
        for data, weight in self._contexts():
            comp = self._comp(weight)
            if comp is None:
                cast_into(data, weight)
            else:
                nd.elemwise_add(cast(data, FLOAT32), cast(comp, FLOAT32), out=weight)

    def split(self, weight: nd.NDArray, data: nd.NDArray) -> None:
        """Store the float32 ``weight`` into the bfloat16 ``data`` by rounding to nearest;
        under kahan keep ``c = nearest(weight - data)``. The working master then holds
        ``w + c`` (kahan) or ``w``: the best value the strategy knows."""
        cast_into(weight, data)
        rounded = cast(data, FLOAT32)
        comp = self._comp(weight)
        if comp is None:
            rounded.copyto(weight)
            return
        cast_into(weight - rounded, comp)  # exact difference, rounded to nearest once
        nd.elemwise_add(rounded, cast(comp, FLOAT32), out=weight)

    def store(self, copies: Sequence[tuple[nd.NDArray, nd.NDArray]]) -> list[tuple[Any, Any]]:
        """Put the updated working masters of ``copies`` ((working master, model data) per
        updated context, parameter by parameter) into the bfloat16 weights: kahan splits,
        stochastic rounds with fresh noise per parameter. Returns the copies it does not
        handle, for the Trainer's plain cast."""
        rest: list[tuple[Any, Any]] = []
        mine: list[tuple[int, nd.NDArray, nd.NDArray]] = []
        for weight, data in copies:
            if self.handles(weight):
                mine.append((self._arrays[id(weight)][0], weight, data))
            else:
                rest.append((weight, data))
        if self.strategy == KAHAN:
            for _, weight, data in mine:
                self.split(weight, data)
            return rest
        noise = {  # one draw per parameter, in the pairs' order, shared by its contexts
            index: self.rng.integers(0, 1 << 16, size=self.pairs[index][0].shape, dtype=np.uint32)
            for index in sorted({index for index, _, _ in mine})
        }
        for index, weight, data in mine:
            weight[:] = round_stochastic(weight.asnumpy(), noise[index])
            cast_into(weight, data)  # on the bfloat16 grid now: exact
        return rest

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self, names: Mapping[int, str]) -> dict[str, Any]:
        """The exact compensation (float32 NumPy arrays of the first context, by the name
        ``names[id(param)]`` gives each parameter) and the random stream's state."""
        comps = {}
        if self.strategy == KAHAN:
            for param, master in self.pairs:
                comp = self._comp(master.list_data()[0])
                assert comp is not None
                comps[names.get(id(param), param.name)] = cast(comp, FLOAT32).asnumpy()
        return {
            "strategy": self.strategy,
            "names": [names.get(id(p), p.name) for p, _ in self.pairs],
            "compensation": comps,
            "rng": dict(self.rng.bit_generator.state),
        }

    def check_state_dict(self, state: Any, filename: str, names: Mapping[int, str]) -> None:
        """Refuse saved compensation state that does not fit, before anything is loaded."""
        here = {names.get(id(p), p.name): tuple(p.shape) for p, _ in self.pairs}
        fits = isinstance(state, Mapping) and state.get("strategy") == self.strategy
        if fits:
            comps = state.get("compensation")
            fits = (
                sorted(state.get("names", ())) == sorted(here)
                and isinstance(state.get("rng"), Mapping)
                and isinstance(comps, Mapping)
            )
            if fits and self.strategy == KAHAN:
                fits = {n: tuple(np.shape(c)) for n, c in comps.items()} == here
        if not fits:
            raise CheckpointError(
                f"{filename!r} holds no master={self.strategy} state for these parameters; "
                "save it with trainer.save_states() from a Trainer with the same policy and net"
            )

    def load_state_dict(self, state: Mapping[str, Any], names: Mapping[int, str]) -> None:
        """Put back the saved compensation and random stream. Each weight becomes
        ``nearest(saved - c)`` (``saved`` being what the working master holds, as
        ``load_parameters`` left it): the weight that was saved, bit for bit."""
        for param, master in self.pairs:
            for data, weight in zip(param.list_data(), master.list_data(), strict=True):
                comp = self._comp(weight)
                if comp is None:
                    continue
                saved = nd.empty(data.shape, data.context)  # float32; nd.array may warn
                name = names.get(id(param), param.name)
                saved[:] = np.asarray(state["compensation"][name], dtype=np.float32)
                cast_into(saved, comp)
                cast_into(weight - saved, data)
                nd.elemwise_add(cast(data, FLOAT32), saved, out=weight)
        self.rng.bit_generator.state = dict(state["rng"])


def compensated_pairs(
    pairs: Sequence[tuple[gluon.Parameter, gluon.Parameter]],
) -> list[tuple[gluon.Parameter, gluon.Parameter]]:
    """The (model parameter, working master) pairs a strategy compensates: bfloat16 params
    with a gradient (float32 ones, such as pinned modules, are updated as they are)."""
    return [
        (p, m)
        for p, m in pairs
        if m is not p and p.grad_req != "null" and dtype_name(p.dtype) == BFLOAT16
    ]


# ---------------------------------------------------------------------- state="bfloat16"


_F32 = np.dtype(np.float32)
_QUIET = np.uint16(0x0040)


def is_bfloat16(array: Any) -> bool:
    """Whether ``array`` is a bfloat16 NDArray."""
    return isinstance(array, nd.NDArray) and np.dtype(array.dtype) == BFLOAT16_NP


def widened(state: Any, ctx: mx.Context | None = None) -> Any:
    """``state`` with every bfloat16 NDArray widened exactly into a float32 one (on ``ctx``,
    default the array's context); other arrays stay."""

    def widen(_: int, array: Any) -> Any:
        if not is_bfloat16(array):
            return array
        # Cast, not amp_cast: widening is exact either way, and on a CPU without bfloat16
        # instructions amp_cast costs about 20 times as much (bf16_rounding)
        wide = nd.Cast(array, dtype=_F32)
        return wide if ctx is None or wide.context == ctx else wide.as_in_context(ctx)

    return map_arrays(state, widen)


def _rounds(array: Any, shape: Sequence[int]) -> bool:
    """Whether ``array`` is a state array the policy keeps in bfloat16: a dense float32
    NDArray of the parameter's ``shape``."""
    return (
        type(array) is nd.NDArray
        and array.stype == "default"
        and np.dtype(array.dtype) == _F32
        and tuple(array.shape) == tuple(shape)
    )


def _bfloat16(values: npt.NDArray[np.float32], ctx: mx.Context) -> nd.NDArray:
    """A bfloat16 NDArray on ``ctx`` holding float32 ``values`` that are on the bfloat16
    grid (their low 16 bits clear; a NaN stays a NaN): the high half of each pattern."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    high = (bits >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():  # a NaN whose payload sat in the low half would read as inf
        high[nan] |= _QUIET
    out = nd.empty(values.shape, ctx=ctx, dtype=BFLOAT16_NP)
    if values.size:
        out[:] = high.view(BFLOAT16_NP)
    return out


class StateRounding:
    """The bfloat16 optimizer state of one Trainer's compensated parameters (the module).

    :param compensation: the strategy whose parameters' state is kept in bfloat16, and
        whose generator draws the noise (its ``pairs`` give the order).
    :param index_of: ``id(model parameter)`` -> the Trainer's index of it (the key of its
        state in ``updater.states``).
    """

    def __init__(self, compensation: Compensation, index_of: Mapping[int, int]) -> None:
        self.compensation = compensation
        #: the Trainer index of each compensated parameter, in the order noise is drawn in
        self.indices = [index_of[id(param)] for param, _ in compensation.pairs]
        self.shapes = {
            i: tuple(param.shape)
            for i, (param, _) in zip(self.indices, compensation.pairs, strict=True)
        }
        self._stepping: list[tuple[Any, dict[int, nd.NDArray]]] = []
        """The updaters :meth:`widen` saw this step, each with its updated compensated
        parameters' weights by index."""

    def rounds(self, index: int) -> bool:
        """Whether the parameter at ``index`` keeps its state in bfloat16."""
        return index in self.shapes

    # ------------------------------------------------------------------ the step

    def begin(self) -> None:
        """A step's update starts (whatever an interrupted one left is forgotten: its
        states are float32 then, and the next :meth:`narrow` rounds them)."""
        self._stepping = []

    def widen(self, updater: Any, indices: Sequence[int], weights: Sequence[nd.NDArray]) -> None:
        """Before ``updater`` updates ``weights``: the bfloat16 state of the compensated
        ones widened into float32 arrays on each weight's context."""
        mine: dict[int, nd.NDArray] = {}
        for index, weight in zip(indices, weights, strict=True):
            if index not in self.shapes:
                continue
            mine[index] = weight
            state = updater.states.get(index)
            if state is not None:
                updater.states[index] = widened(state, weight.context)
        self._stepping.append((updater, mine))

    def narrow(self) -> None:
        """After every context's update and the weights' rounding: each updated state array
        rounded stochastically into a bfloat16 NDArray, the noise drawn per parameter (net
        order) and state array, shared by the contexts."""
        stepping, self._stepping = self._stepping, []
        rng = self.compensation.rng
        for index in self.indices:
            held = [(u, mine[index]) for u, mine in stepping if index in mine]
            states = [u.states.get(index) for u, _ in held]
            if not held or any(s is None for s in states):
                continue
            shape = self.shapes[index]
            positions = _positions(states[0], shape)
            rounded: list[dict[int, nd.NDArray]] = [{} for _ in held]
            for position in positions:
                noise = rng.integers(0, 1 << 16, size=shape, dtype=np.uint32)
                for j, ((_, weight), state) in enumerate(zip(held, states, strict=True)):
                    array = _at(state, position)
                    if not _rounds(array, shape):
                        continue  # a replica whose state is not float32 here keeps it
                    values = round_stochastic(array.asnumpy(), noise)
                    rounded[j][position] = _bfloat16(values, weight.context)
            for (updater, _), state, new in zip(held, states, rounded, strict=True):
                updater.states[index] = map_arrays(state, new.get)

    # ------------------------------------------------------------------ checkpoints

    def adopt(self, index: int, state: Any, shape: Sequence[int]) -> Any:
        """A loaded (checked, float32) state as this policy keeps it: for a compensated
        parameter each state array rounded to the nearest bfloat16 value (exact for values
        saved in bfloat16; no noise drawn), else as it is."""
        if index not in self.shapes:
            return state

        def narrow(_: int, array: Any) -> Any:
            return cast(array, BFLOAT16) if _rounds(array, shape) else array

        return map_arrays(state, narrow)


def _positions(state: Any, shape: Sequence[int]) -> list[int]:
    """The positions of ``state``'s arrays kept in bfloat16: float32 ones of ``shape``."""
    found: list[int] = []
    map_arrays(state, lambda p, a: found.append(p) if _rounds(a, shape) else None)
    return found


def _at(state: Any, position: int) -> Any:
    return state[position] if isinstance(state, (tuple, list)) else state
