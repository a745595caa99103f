"""``trainer.save_states`` / ``load_states``: the optimizer state, the loss scale, the policy.

The file holds data, never code (:mod:`.state_files`). ``load_states`` reads and checks the
whole file first: the format, the policy (it must be the Trainer's), the loss-scaler state, the
optimizer's class and schedule, every per-parameter state (index and shape) and, under
``master=kahan|stochastic``, the compensation. Only then does it change anything; a file
refused with :class:`~mixprec.errors.CheckpointError` leaves the loss scale, the optimizer and
the weights as they were. The optimizer that trains on is the Trainer's own: it takes the
saved update counts, learning rate and schedule counters (what a bit-exact resume needs).

Under a low-bit ``state`` (``int8``, ``int4``, ``fp8``) the file holds the codes as they are
kept between steps, and resumes bit for bit. The policy must match but for its ``state``
item: codes written under another format or block size are refused (before anything
changes); a float32 state (saved without a low-bit ``state``, or by ``gluon.Trainer``) is
encoded on load, lossy as a step is; codes of parameters this Trainer keeps in float32 (no
low-bit ``state``, or ``min_size``/``keep`` changed) are decoded: the way back to float32.

Under ``state=bfloat16`` the file holds the compensated parameters' optimizer state as the
bfloat16 arrays kept between steps (with the strategy's random stream), and resumes bit for
bit. As with a low-bit format the policy must match but for its ``state`` item: a float32
state is rounded to the nearest bfloat16 value on load (no noise drawn), codes are decoded
first; a Trainer without ``state=bfloat16`` widens bfloat16 arrays into float32 exactly.

Optimizer state is matched to parameters by their structural names (``"0.weight"``), so a
net whose Gluon names (``dense3_weight``) differ from the saved one's resumes all the same.
A plain ``gluon.Trainer`` states file loads too (the loss scale then starts afresh, with a
warning).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import stat
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
from mxnet import gluon, nd

from mixprec.errors import CheckpointError, MixprecError, MixprecWarning
from mixprec.kit import LossScaler, Policy, atomic_path

from ..compensated.compensation import is_bfloat16, widened
from ..gluon_private import set_update_counts
from ..lowbit.state import LowBitArray, check_saved, decoded
from .checkpoint import save_arrays
from .state_files import SavedStates, optimizer_record, read_states, seal, states_arrays
from .trainer_state import TrainerState, names_by_id, param_names, state_rounding, trainer_state

__all__ = ["load_states", "save_states"]

_PRIMITIVES = (bool, int, float, str, type(None))
_F32 = np.dtype(np.float32)


def save_states(trainer: gluon.Trainer, filename: str) -> None:
    """Write the optimizer state, the loss-scaler state and the policy to ``filename``
    (atomically: a failed save leaves the previous file whole)."""
    st = trainer_state(trainer)
    meta: dict[str, Any] = {
        "policy": st.policy.to_dict(),
        "scaler": st.scaler.state_dict(),
        "names": param_names(st),
        "optimizer": optimizer_record(trainer._optimizer),
    }
    compensation: dict[str, nd.NDArray] = {}
    if st.compensation is not None:  # the exact compensation and the random stream
        state = st.compensation.state_dict(names_by_id(st))
        meta["compensation"] = {k: v for k, v in state.items() if k != "compensation"}
        compensation = {name: _ndarray(v) for name, v in state["compensation"].items()}
    arrays = states_arrays(meta, trainer._updaters[0].states, compensation)
    with atomic_path(filename) as tmp:
        save_arrays(tmp, arrays, filename)
        with open(tmp, "rb") as f:
            body = f.read()
        with open(tmp, "ab") as f:  # the checksum line (state_files: format /3)
            f.write(seal(body))


def _ndarray(values: npt.NDArray[Any]) -> nd.NDArray:
    out = nd.empty(values.shape, dtype=values.dtype)  # nd.array may warn (SciPy)
    out[:] = values
    return out


def load_states(trainer: gluon.Trainer, filename: str) -> None:
    """Restore what :func:`save_states` wrote into ``trainer`` (whose policy must match).

    :raises CheckpointError: the file is damaged, or was saved under another policy,
        optimizer or net; nothing has changed then.
    """
    st = trainer_state(trainer)
    raw = _read_bounded(st, filename)
    saved = read_states(raw, filename)
    scaler_state = _check_policy_and_scaler(st, saved, filename)
    per_param, counts = _renumbered(st, saved)
    _check_per_param(st, per_param, filename)
    record = saved.meta.get("optimizer")
    if record is not None:
        _check_optimizer(trainer._optimizer, record, counts, filename)
    compensation = st.compensation
    names = names_by_id(st)
    comp_state: Any = None
    if compensation is not None:
        comp_state = saved.meta.get("compensation")
        if isinstance(comp_state, Mapping):
            comp_state = dict(comp_state, compensation=saved.compensation)
        compensation.check_state_dict(comp_state, filename, names)
    per_param = _adopted(st, per_param)  # encoded or decoded as this policy keeps them
    # checked: from here on nothing raises on the file's account
    if saved.kind == "gluon":
        warnings.warn(
            f"{filename!r} is a plain gluon.Trainer states file: the optimizer state is loaded "
            "but the loss scale starts afresh (trainer.save_states() also saves it)",
            MixprecWarning,
            stacklevel=3,
        )
    if scaler_state is not None:
        st.scaler.load_state_dict(scaler_state)
    if compensation is not None:
        compensation.load_state_dict(comp_state, names)
    if record is not None:
        _apply_optimizer(trainer._optimizer, record, counts)
    for updater in trainer._updaters:
        updater.states = {i: copy.deepcopy(state) for i, state in per_param.items()}
        updater.states_synced = dict.fromkeys(updater.states, False)


#: Bytes a states file may hold per parameter element (eight float64 state arrays and a
#: float32 compensation: more than any MXNet optimizer keeps), plus room for the header.
_BYTES_PER_ELEMENT = 8 * 8 + 4
_HEADER_ROOM = 16 << 20


def _read_bounded(st: TrainerState, filename: str) -> bytes:
    """The file's bytes, after checking on the open descriptor that it is a regular file no
    larger than this trainer's states can be (a device, a FIFO or a huge file is refused
    before anything is read whole)."""
    elements = sum(int(np.prod(p.shape)) for p in st.params if p.shape is not None)
    limit = _HEADER_ROOM + _BYTES_PER_ELEMENT * elements
    with open(filename, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(
                f"{filename!r} is not a regular file; load the file trainer.save_states() wrote"
            )
        if info.st_size > limit:
            raise CheckpointError(
                f"{filename!r} holds {info.st_size} bytes, more than the states of this "
                f"Trainer's {elements} parameter elements can take ({limit}); it is not a "
                "states file of this net: load the one trainer.save_states() wrote for it"
            )
        raw = f.read(limit + 1)
    if len(raw) > limit:  # the file grew while it was read
        raise CheckpointError(f"{filename!r} changed while it was read; load it again")
    return raw


def _check_policy_and_scaler(
    st: TrainerState, saved: SavedStates, filename: str
) -> dict[str, Any] | None:
    if saved.kind == "gluon":
        return None
    try:
        policy = Policy.from_dict(saved.meta["policy"])
    except (MixprecError, TypeError, ValueError, AttributeError, KeyError) as err:
        raise CheckpointError(f"{filename!r} holds a malformed policy: {err}") from err
    if _without_state(policy) != _without_state(st.policy):
        raise CheckpointError(
            f"{filename!r} was saved under policy {policy} but this Trainer runs "
            f"{st.policy}; build the Trainer with policy={str(policy)!r} to resume"
        )
    state = saved.meta.get("scaler")
    # a probe takes the state first: a malformed one raises before the scaler changes
    try:
        LossScaler(st.scaler.state.fresh()).load_state_dict(state)  # type: ignore[arg-type]
    except (MixprecError, TypeError, ValueError, KeyError, OverflowError) as err:
        raise CheckpointError(f"{filename!r} holds a malformed loss-scaler state: {err}") from err
    return state  # type: ignore[no-any-return]


def _without_state(policy: Policy) -> Policy:
    """``policy`` but for its ``state`` item: a file saved with float32 state loads under a
    low-bit format and the other way round (the states are converted on load, and codes of
    another format are refused array by array, :func:`_check_per_param`)."""
    return dataclasses.replace(policy, state=None)


def _renumbered(st: TrainerState, saved: SavedStates) -> tuple[dict[Any, Any], dict[Any, Any]]:
    """The per-parameter states and update counts at the indices this trainer gives the same
    parameters (``gluon.Trainer`` numbers them by global names, which differ between two nets
    of one architecture built in one process)."""
    record = saved.meta.get("optimizer")
    counts = record.get("counts", {}) if isinstance(record, Mapping) else {}
    names, here = saved.meta.get("names"), param_names(st)
    if not isinstance(names, list) or sorted(names) != sorted(here) or names == here:
        return dict(saved.per_param), dict(counts) if isinstance(counts, Mapping) else {}
    new = {name: i for i, name in enumerate(here)}
    move = {i: new[name] for i, name in enumerate(names)}
    per_param = {move.get(k, k): v for k, v in saved.per_param.items()}
    moved_counts = {
        device: {str(move.get(_int(k), k)): n for k, n in per_index.items()}
        if isinstance(per_index, Mapping)
        else per_index
        for device, per_index in counts.items()
    }
    return per_param, moved_counts


def _int(value: Any) -> Any:
    try:
        return int(value)
    except (TypeError, ValueError):
        return value


def _arrays(state: Any) -> list[Any]:
    if isinstance(state, (list, tuple)):
        return [a for s in state for a in _arrays(s)]
    return [] if state is None else [state]


def _adopted(st: TrainerState, per_param: Mapping[int, Any]) -> dict[int, Any]:
    """The checked per-parameter states as this Trainer keeps them. bfloat16 state arrays
    (saved under ``state=bfloat16``) are first widened into float32, exactly. Then: under a
    low-bit ``state``, float32 moments of the parameters it quantizes encoded and codes of
    the others decoded; under ``state=bfloat16``, codes decoded and the state arrays of the
    compensated parameters rounded to the nearest bfloat16 value (exact for bfloat16 ones);
    without either, every code decoded (the way back to float32 state)."""
    lowbit, rounding = st.lowbit, state_rounding(st)
    adopted = {}
    for i, state in per_param.items():
        state = widened(state)
        if lowbit is not None:
            adopted[i] = lowbit.adopt(i, state, st.params[i].shape)
        elif rounding is not None:
            adopted[i] = rounding.adopt(i, decoded(state), st.params[i].shape)
        else:
            adopted[i] = decoded(state)
    return adopted


def _check_per_param(st: TrainerState, per_param: Mapping[Any, Any], filename: str) -> None:
    """Refuse optimizer state the updater would choke on: unknown indices, wrong shapes."""
    count = len(st.params)
    unknown = sorted(
        (k for k in per_param if not isinstance(k, int) or not 0 <= k < count), key=str
    )
    if unknown:
        raise CheckpointError(
            f"{filename!r} holds optimizer state for parameter indices {unknown[:6]}, but this "
            f"Trainer has {count} parameters; load states saved by a Trainer over the same net"
        )
    masters, names = st.masters, names_by_id(st)
    for index, state in per_param.items():
        param = st.params[index]
        name = names.get(id(param), param.name)  # "0.weight", as net.save_parameters keys it
        # the array the optimizer updates, whose dtype its state has (unknown before the
        # masters exist: deferred shapes)
        expected = np.dtype(masters.master_for(param).dtype) if masters is not None else None
        for position, array in enumerate(_arrays(state)):
            if isinstance(array, LowBitArray):  # state=int8|int4|fp8: the codes as saved
                layout = st.lowbit.layout if st.lowbit is not None else ()
                signed = layout[position] if position < len(layout) else None
                where = f"the optimizer state of parameter {name!r} (state {position})"
                check_saved(array, param.shape, signed, st.lowbit, filename, where)
                continue
            if not isinstance(array, nd.NDArray) or tuple(array.shape) != tuple(param.shape):
                shape = getattr(array, "shape", type(array).__name__)
                raise CheckpointError(
                    f"{filename!r} holds optimizer state of shape {shape} for parameter "
                    f"{param.name!r} of shape {param.shape}; load states saved by a Trainer "
                    "over the same net"
                )
            bf16 = is_bfloat16(array)  # state=bfloat16: a float32 state as kept between steps
            if bf16 and expected in (None, _F32):
                array = widened(array)
            elif expected is not None and np.dtype(array.dtype) != expected:
                raise CheckpointError(
                    f"{filename!r} holds {np.dtype(array.dtype).name} optimizer state "
                    f"(parameter {name!r}, state {position}) where this Trainer keeps "
                    f"{expected.name} (the dtype of the array it updates under policy "
                    f"{st.policy.label}); load states saved by a Trainer under the same policy "
                    "(nothing was loaded)"
                )
            if np.dtype(array.dtype).kind == "f" and not np.isfinite(array.asnumpy()).all():
                raise CheckpointError(
                    f"{filename!r} holds an inf or NaN in the optimizer state of parameter "
                    f"{name!r} (state {position}); loaded, it would reach the weights at "
                    "the next step. The file is damaged: load an earlier checkpoint (nothing "
                    "was loaded)"
                )


def _check_optimizer(optimizer: Any, record: Any, counts: Any, filename: str) -> None:
    name = type(optimizer).__name__
    saved = record.get("class") if isinstance(record, Mapping) else None
    if saved != name:
        raise CheckpointError(
            f"{filename!r} holds the state of a {saved} optimizer, but this Trainer uses "
            f"{name}; build the Trainer with the optimizer the states were saved with"
        )
    try:
        ok = isinstance(record.get("fields"), Mapping) and all(
            isinstance(int(device), int)
            and all(isinstance(int(k), int) and type(n) is int for k, n in per_index.items())
            for device, per_index in counts.items()
        )
    except (TypeError, ValueError, AttributeError):
        ok = False
    if not ok:
        raise CheckpointError(
            f"{filename!r} holds malformed optimizer settings; it is damaged: load an earlier "
            "checkpoint, or save it again with trainer.save_states()"
        )
    schedule, mine = record.get("scheduler"), getattr(optimizer, "lr_scheduler", None)
    if schedule is not None:
        theirs = schedule.get("class") if isinstance(schedule, Mapping) else None
        if mine is None or type(mine).__name__ != theirs:
            raise CheckpointError(
                f"{filename!r} was saved with lr_scheduler={theirs}, but this Trainer's "
                f"optimizer has {type(mine).__name__ if mine is not None else 'none'}; pass "
                "the same kind of schedule (its counters are restored from the file)"
            )


def _set_fields(target: Any, fields: Mapping[str, Any]) -> None:
    """Set the saved plain settings (numbers, strings, lists of them) that ``target`` has,
    each only where the kinds agree; never a new attribute, never an object."""
    for name, value in fields.items():
        if name in _KEEP or not hasattr(target, name):
            continue
        current = getattr(target, name)
        if isinstance(current, _PRIMITIVES) and isinstance(value, _PRIMITIVES):
            if isinstance(current, bool) == isinstance(value, bool):
                setattr(target, name, value)
        elif isinstance(current, list) and isinstance(value, list):
            setattr(target, name, copy.deepcopy(value))


#: Settings the Trainer's optimizer keeps: its per-parameter multipliers and names follow
#: this Trainer's parameters, not the file's.
_KEEP = frozenset({"lr_mult", "wd_mult", "idx2name", "param_dict", "sym_info"})


def _apply_optimizer(optimizer: Any, record: Mapping[str, Any], counts: Any) -> None:
    _set_fields(optimizer, record["fields"])
    set_update_counts(
        optimizer,
        {
            int(device): {int(k): int(n) for k, n in per_index.items()}
            for device, per_index in counts.items()
        },
    )
    schedule = record.get("scheduler")
    if schedule is not None:
        _set_fields(optimizer.lr_scheduler, schedule.get("fields", {}))
