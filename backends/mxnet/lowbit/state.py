"""The MXNet optimizer's state kept quantized between steps, widened to float32 around its
update.

Under a policy whose ``state`` is a low-bit format (:mod:`mixprec.numerics.lowbit`), every
parameter the format quantizes (at least ``min_size`` elements, not named by ``keep``) keeps,
between two steps, in each context's ``updater.states[index]``, a :class:`LowBitArray` where
the optimizer had a float32 moment: the codes (a flat ``uint8`` NDArray, two codes a byte for
``int4``) and the blocks' float32 absmax, both on the moment's context, with the shape, the
map (signed for the first moment and momentum, unsigned for the second moment) and the
format's tag (``"int8/256"``: name and block size). The structure around them stays the
optimizer's (an array for momentum, ``(mean, var)`` for the Adam family).

The step (:mod:`~mixprec_mxnet.step.protocol`): :meth:`LowBitState.widen`, before an
updater's update, decodes the codes of the indices it updates into fresh float32 arrays on the
weight's context; the optimizer's own update (Gluon's updater or the multi-tensor kernels)
runs on them as on any float32 state; :meth:`LowBitState.narrow`, after every context's
update, encodes them again (a first step's fresh state too), first checking every block's
absmax is finite: if one is not, every state keeps what it had before the step (a state the
step created is dropped) and :class:`~mixprec.errors.PolicyError` names the parameter. A
skipped step reaches neither, so its codes and absmax stay bit for bit. Each context encodes
its own replica; replicas that hold the same float32 values get the same codes, so
multi-context and ``dist_sync`` training behave as with float32 state.

Which optimizers: those whose state is known moment by moment (:data:`LAYOUTS`): ``sgd`` and
``nag`` (the momentum, signed; none without momentum), ``adam``, ``adamw`` and ``lamb``
(``(mean, var)``: signed, unsigned), as registered under those names, subclasses excluded (a
subclass may keep other things in the same places). :func:`layout_of` refuses the rest.

Checkpoints: the states file stores the codes (:mod:`~mixprec_mxnet.step.state_files`);
:func:`check_saved` refuses, before anything is loaded, codes written under another format or
block size, or codes that do not fit their parameter; :meth:`LowBitState.adopt` encodes a
float32 state (a file saved without a low-bit state, or by a plain ``gluon.Trainer``) and
decodes the codes of a parameter the policy now keeps in float32 (``min_size`` or ``keep``
changed); :func:`decoded` is the way back out (a Trainer without a low-bit ``state`` decodes
every code it loads).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import mxnet as mx
import numpy as np
import numpy.typing as npt
from mxnet import nd

from mixprec.errors import CheckpointError, PolicyError, WrapError
from mixprec.kit import StateFormat, parse_state_format

from ..dtypes import map_arrays
from .codec import block_count, code_count, dequantize, quantize, tables

__all__ = [
    "LAYOUTS",
    "LowBitArray",
    "LowBitState",
    "check_saved",
    "decoded",
    "format_of",
    "layout_of",
    "state_bytes",
    "tag_of",
]

#: Per optimizer (its registered name): the map of each state array, by position (True:
#: signed, first moment or momentum; False: unsigned, second moment).
LAYOUTS: dict[str, tuple[bool, ...]] = {
    "sgd": (True,),
    "nag": (True,),
    "adam": (True, False),
    "adamw": (True, False),
    "lamb": (True, False),
}
_F32 = np.dtype(np.float32)
_U8 = np.dtype(np.uint8)


def tag_of(fmt: StateFormat) -> str:
    """The tag codes are written under: the format and its block size (``"int8/256"``)."""
    return f"{fmt.name}/{fmt.block}"


@functools.lru_cache(maxsize=64)
def format_of(tag: str) -> StateFormat | None:
    """The format a tag names (its block size included), or None for no tag of a format."""
    name, slash, block = tag.partition("/")
    if not slash or not block.isdigit() or parse_state_format(name) is None:
        return None
    try:
        return parse_state_format(f"{name}(block={int(block)})")
    except PolicyError:
        return None


def layout_of(optimizer: Any, fmt: StateFormat) -> tuple[bool, ...]:
    """The map of each of ``optimizer``'s state arrays (:data:`LAYOUTS`).

    :raises WrapError: an optimizer whose state mixprec does not know how to quantize.
    """
    kind = type(optimizer)
    name = kind.__name__.lower()
    if name in LAYOUTS and mx.optimizer.Optimizer.opt_registry.get(name) is kind:
        return LAYOUTS[name]
    raise WrapError(
        f"state={fmt} quantizes the state of the optimizers {', '.join(repr(n) for n in LAYOUTS)} "
        f"(momentum; Adam's mean and variance), but this Trainer's optimizer is "
        f"{kind.__name__}, whose state mixprec does not know how to quantize. Use one of "
        "those optimizers, or a policy without a low-bit state (drop state=...)"
    )


# ---------------------------------------------------------------------- one array


def _ndarray(values: npt.NDArray[Any], ctx: mx.Context) -> nd.NDArray:
    out = nd.empty(values.shape, ctx=ctx, dtype=values.dtype)  # nd.array may warn (SciPy)
    if values.size:
        out[:] = values
    return out


class LowBitArray:
    """One optimizer state array between steps: its codes and block absmax (see the module).

    :param codes: flat ``uint8`` NDArray (two codes a byte for 4-bit formats).
    :param absmax: flat float32 NDArray, one per block, on the same context.
    :param shape: the shape of the array the codes stand for.
    :param signed: the map: signed (momentum, first moment) or unsigned (second moment).
    :param tag: the format and block size the codes were written under (:func:`tag_of`).
    """

    __slots__ = ("absmax", "codes", "shape", "signed", "tag")

    def __init__(
        self, codes: nd.NDArray, absmax: nd.NDArray, shape: Sequence[int], signed: bool, tag: str
    ) -> None:
        self.codes = codes
        self.absmax = absmax
        self.shape = tuple(int(n) for n in shape)
        self.signed = bool(signed)
        self.tag = tag

    @classmethod
    def encode(
        cls, values: npt.NDArray[Any], fmt: StateFormat, signed: bool, ctx: mx.Context
    ) -> LowBitArray:
        """The codes of float32 ``values``, held on ``ctx``."""
        codes, scale = quantize(values, fmt, signed)
        return cls(_ndarray(codes, ctx), _ndarray(scale, ctx), values.shape, signed, tag_of(fmt))

    @property
    def size(self) -> int:
        """Elements of the array the codes stand for."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def context(self) -> mx.Context:
        return self.codes.context

    @property
    def nbytes(self) -> int:
        """Bytes held between steps: the codes and the absmax."""
        return int(self.codes.size) + 4 * int(self.absmax.size)

    def finite(self) -> bool:
        """Whether every block's absmax is finite (a non-finite one decodes as garbage)."""
        return bool(np.isfinite(self.absmax.asnumpy()).all())

    def numpy(self) -> npt.NDArray[np.float32]:
        """The float32 values the codes stand for, in the array's shape."""
        fmt = format_of(self.tag)
        assert fmt is not None, "LowBitArray tags are checked where they are made or loaded"
        flat = dequantize(self.codes.asnumpy(), self.absmax.asnumpy(), fmt, self.signed, self.size)
        return flat.reshape(self.shape)

    def decode(self, ctx: mx.Context | None = None) -> nd.NDArray:
        """The float32 NDArray the codes stand for, on ``ctx`` (default: the codes')."""
        return _ndarray(self.numpy(), ctx or self.context)

    def __deepcopy__(self, memo: dict[int, Any]) -> LowBitArray:
        return LowBitArray(self.codes.copy(), self.absmax.copy(), self.shape, self.signed, self.tag)

    def __repr__(self) -> str:
        kind = "signed" if self.signed else "unsigned"
        return f"<LowBitArray {self.tag} {kind} {self.shape} @{self.context}>"


def _holds_codes(state: Any) -> bool:
    if isinstance(state, (tuple, list)):
        return any(isinstance(a, LowBitArray) for a in state)
    return isinstance(state, LowBitArray)


def decoded(state: Any, ctx: mx.Context | None = None) -> Any:
    """``state`` with every :class:`LowBitArray` decoded into a float32 NDArray (on ``ctx``,
    default the codes' context)."""
    return map_arrays(state, lambda _, a: a.decode(ctx) if isinstance(a, LowBitArray) else a)


def state_bytes(states: dict[Any, Any]) -> int:
    """Bytes an updater's ``states`` hold in arrays (codes and absmax, or NDArrays)."""
    total = 0

    def count(_: int, array: Any) -> Any:
        nonlocal total
        if isinstance(array, LowBitArray):
            total += array.nbytes
        elif isinstance(array, nd.NDArray):
            total += int(array.size) * np.dtype(array.dtype).itemsize
        return array

    for state in states.values():
        map_arrays(state, count)
    return total


# ---------------------------------------------------------------------- the Trainer's state


class LowBitState:
    """The quantized state of one Trainer's optimizer (see the module).

    :param fmt: the policy's low-bit format.
    :param layout: the map of each of the optimizer's state arrays (:func:`layout_of`).
    :param names: each parameter's name, by the Trainer's index (``keep`` matches them).
    """

    def __init__(self, fmt: StateFormat, layout: Sequence[bool], names: Sequence[str]) -> None:
        self.fmt = fmt
        self.tag = tag_of(fmt)
        self.layout = tuple(layout)
        self.names = list(names)
        self._stepping: list[tuple[Any, list[int], list[nd.NDArray]]] = []
        """The updaters :meth:`widen` saw this step, with the indices and weights updated."""
        self._held: dict[tuple[int, int], Any] = {}
        """(id(updater), index) -> the quantized state :meth:`widen` decoded this step."""

    def name(self, index: int) -> str:
        return self.names[index] if 0 <= index < len(self.names) else f"index {index}"

    def quantizes(self, index: int, numel: int) -> bool:
        """Whether the parameter at ``index`` with ``numel`` elements keeps low-bit state."""
        known = 0 <= index < len(self.names)
        return numel > 0 and self.fmt.quantizes(numel, self.names[index] if known else None)

    def _moment(self, position: int, array: Any, shape: Sequence[int]) -> bool:
        return (
            position < len(self.layout)
            and type(array) is nd.NDArray
            and array.stype == "default"
            and np.dtype(array.dtype) == _F32
            and tuple(array.shape) == tuple(shape)
        )

    def encoded(self, state: Any, shape: Sequence[int], ctx: mx.Context | None = None) -> Any:
        """``state`` with each float32 moment of ``shape`` encoded (on ``ctx``, default the
        moment's context); codes and other arrays stay."""

        def encode(position: int, array: Any) -> Any:
            if not self._moment(position, array, shape):
                return array
            values = array.asnumpy()
            return LowBitArray.encode(values, self.fmt, self.layout[position], ctx or array.context)

        return map_arrays(state, encode)

    # ------------------------------------------------------------------ the step

    def begin(self) -> None:
        """A step's update starts (whatever an interrupted one left is forgotten: its
        states are float32 then, and the next :meth:`narrow` encodes them)."""
        self._stepping, self._held = [], {}

    def widen(self, updater: Any, indices: Sequence[int], weights: Sequence[nd.NDArray]) -> None:
        """Before ``updater`` updates ``weights``: the codes of their states decoded into
        float32 arrays on each weight's context."""
        self._stepping.append((updater, list(indices), list(weights)))
        for index, weight in zip(indices, weights, strict=True):
            state = updater.states.get(index)
            if _holds_codes(state):
                self._held[(id(updater), index)] = state
                updater.states[index] = decoded(state, weight.context)

    def narrow(self) -> None:
        """After every context's update: the states of the quantized parameters encoded.

        :raises PolicyError: a moment holds inf or NaN; every state is left as it was before
            the step (a state the step created is dropped).
        """
        stepping, self._stepping = self._stepping, []
        held, self._held = self._held, {}
        encoded: list[tuple[Any, int, Any]] = []
        for updater, indices, weights in stepping:
            for index, weight in zip(indices, weights, strict=True):
                state = updater.states.get(index)
                if state is None or not self.quantizes(index, int(weight.size)):
                    continue
                encoded.append((updater, index, self.encoded(state, weight.shape)))
        bad = next((e for e in encoded if not _finite(e[2])), None)
        if bad is not None:
            for updater, index, _ in encoded:
                before = held.get((id(updater), index))
                if before is not None:
                    updater.states[index] = before
                else:  # no codes before the step: it made this state (or an interrupted
                    # step left it float32), and its values are not to be trained on
                    updater.states.pop(index, None)
                    updater.states_synced.pop(index, None)
            raise PolicyError(
                f"state={self.fmt}: the optimizer's update made the state of parameter "
                f"{self.name(bad[1])!r} inf or NaN, which a quantized state cannot hold (the "
                "state was left as before the step). Lower the learning rate or clip the "
                f"gradients, or keep this parameter's state in float32 (state={self.fmt.name}"
                f"(keep={self.name(bad[1])}))"
            )
        for updater, index, state in encoded:
            updater.states[index] = state

    # ------------------------------------------------------------------ checkpoints

    def adopt(self, index: int, state: Any, shape: Sequence[int]) -> Any:
        """A loaded (checked) state as this policy keeps it: float32 moments of a quantized
        parameter encoded, codes of a parameter kept in float32 decoded."""
        numel = int(np.prod(shape, dtype=np.int64))
        if self.quantizes(index, numel):
            return self.encoded(state, shape)
        return decoded(state)


def _finite(state: Any) -> bool:
    ok = True

    def check(_: int, array: Any) -> Any:
        nonlocal ok
        if ok and isinstance(array, LowBitArray):
            ok = array.finite()
        return array

    map_arrays(state, check)
    return ok


def check_saved(
    array: LowBitArray,
    shape: Sequence[int],
    signed: bool | None,
    lowbit: LowBitState | None,
    filename: str,
    where: str,
) -> None:
    """Refuse saved codes that do not fit: written under another format or block size than
    ``lowbit``'s, of another shape, sizes or map, out-of-range codes, a non-finite or
    negative absmax.

    :param signed: the map the optimizer's layout expects at this position (None: unknown).
    :param where: the parameter and the position, for the message.
    :raises CheckpointError: what is wrong and how to convert the file.
    """
    fmt = format_of(array.tag)
    if fmt is None:
        raise CheckpointError(
            f"{filename!r} holds {where} quantized under {array.tag!r}, which names no low-bit "
            "format; the file is damaged: load an earlier checkpoint (nothing was loaded)"
        )
    if lowbit is not None and array.tag != lowbit.tag:
        raise CheckpointError(
            f"{filename!r} holds {where} quantized as {array.tag!r}, but this Trainer keeps its "
            f"optimizer state as {lowbit.tag!r} (policy state={lowbit.fmt}); nothing was loaded. "
            f"Build the Trainer with the file's format (state={StateFormat(fmt.name, fmt.block)}), "
            "or convert the file: load it into a Trainer whose policy has no state item (it "
            "decodes the codes into float32), save_states again, and load that file: a float32 "
            "state loads under any format"
        )
    numel = int(np.prod(shape, dtype=np.int64))
    fits = (
        array.shape == tuple(shape)
        and np.dtype(array.codes.dtype) == _U8
        and np.dtype(array.absmax.dtype) == _F32
        and array.codes.shape == (code_count(fmt, numel),)
        and array.absmax.shape == (block_count(fmt, numel),)
        and (signed is None or signed == array.signed)
    )
    if not fits:
        raise CheckpointError(
            f"{filename!r} holds {where} that does not fit its parameter of shape "
            f"{tuple(shape)} under {array.tag} (expected {code_count(fmt, numel)} uint8 codes and "
            f"{block_count(fmt, numel)} float32 absmax of the "
            f"{'signed' if signed in (True, None) else 'unsigned'} map); the file belongs to "
            "another net or optimizer, or is damaged: load the file trainer.save_states() wrote "
            "for this Trainer (nothing was loaded)"
        )
    scale = array.absmax.asnumpy()
    codes = array.codes.asnumpy()
    if fmt.bits == 4:
        codes = np.concatenate([codes & np.uint8(15), codes >> np.uint8(4)])
    count = tables(fmt.name, array.signed).values.size
    if not np.isfinite(scale).all() or (scale < 0).any() or (codes.size and codes.max() >= count):
        raise CheckpointError(
            f"{filename!r} holds {where} with an inf, NaN or negative absmax or a code beyond "
            "the format's map; the file is damaged: load an earlier checkpoint (nothing was "
            "loaded)"
        )
