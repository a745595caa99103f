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
compensation) under kahan.

Checkpoints: ``save_parameters`` writes the working master, ``w + c`` in float32;
``save_states`` adds :meth:`Compensation.state_dict` (the exact compensation and the
generator state). Loading parameters splits each saved value into ``w, c``
(:meth:`Compensation.split`); loading the states afterwards puts back the saved ``c`` and
re-derives ``w = nearest(saved - c)``, the weight that was saved, bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from mxnet import gluon, nd

from mixprec.errors import CheckpointError
from mixprec.kit import BFLOAT16, FLOAT32, KAHAN

from ..dtypes import cast, cast_into, dtype_name

__all__ = ["Compensation", "compensated_pairs", "round_stochastic"]

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
