"""Saving and loading: parameters as float32 master values, trainer states with the scaler.

- ``net.save_parameters(f)`` (patched on the net the Trainer converted) and
  ``trainer.save_parameters(f)`` write every parameter in float32: the master where the
  model holds a low-precision copy, else the parameter itself (bfloat16/float16 values
  upcast exactly). The file is an ordinary Gluon parameter file.
- ``net.load_parameters(f)`` / ``trainer.load_parameters(f)`` write the saved values into
  the masters first, then cast them into the model (round to nearest-even), so a resumed run
  continues from exactly the values an uninterrupted run had.
- Both files are written atomically (:mod:`mixprec.atomic`: a temporary file in the same
  folder, fsync, rename): a save killed or failing half-way leaves the previous file whole.
- ``trainer.save_states(f)`` pickles the optimizer state (MXNet's own format, over the
  masters), the loss-scaler state and the policy (and under ``master=kahan|stochastic`` the
  exact compensation and the random stream); ``load_states`` refuses a file saved under
  another policy. Optimizer state is matched to parameters by the names above, so a net
  whose Gluon names (``dense3_weight``) differ from the saved one's resumes all the same.
- Under ``master=kahan`` the float32 value saved for a bfloat16 weight is ``w + c``, the
  best the strategy knows; loading it splits it again (:mod:`.compensation`).
"""

from __future__ import annotations

import functools
import pickle
import warnings
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import mxnet as mx
from mxnet import gluon, nd

from mixprec.atomic import atomic_path, atomic_write_bytes
from mixprec.dtypes import FLOAT32
from mixprec.errors import CheckpointError, MixprecError, MixprecWarning
from mixprec.policy import Policy
from mixprec.scaler import LossScaler

from .dtypes import cast, cast_into
from .gluon_private import params_with_prefix, reindex_update_counts

if TYPE_CHECKING:
    from .trainer import Trainer

__all__ = ["load_parameters", "load_states", "patch_net", "save_parameters", "save_states"]

STATES_FORMAT = "mixprec-mxnet-states/1"


def patch_net(net: gluon.Block, trainer: Trainer) -> None:
    """Make ``net.save_parameters``/``load_parameters`` go through ``trainer`` (this net only)."""
    net.save_parameters = functools.partial(save_parameters, trainer)
    net.load_parameters = functools.partial(load_parameters, trainer)


def _named_params(trainer: Trainer) -> dict[str, gluon.Parameter]:
    net = trainer._net
    if net is not None:
        return params_with_prefix(net)
    return {p.name: p for p in trainer._params}


def float32_value(trainer: Trainer, param: gluon.Parameter) -> nd.NDArray:
    """``param``'s value in float32 on the CPU: its master's, or its own upcast exactly."""
    source = param if trainer.masters is None else trainer.masters.master_for(param)
    return cast(source.list_data()[0], FLOAT32).copyto(mx.cpu())


def save_parameters(trainer: Trainer, filename: str, deduplicate: bool = False) -> None:
    """Write the parameters as float32 values, keyed like ``Block.save_parameters``."""
    params = _named_params(trainer)
    if deduplicate:
        first = {id(p): name for name, p in reversed(list(params.items()))}
        params = {name: p for name, p in params.items() if first[id(p)] == name}
    values = {name: float32_value(trainer, p) for name, p in params.items()}
    with atomic_path(filename) as tmp:
        nd.save(tmp, values)
        _check_written(tmp, values, filename)


def _check_written(tmp: str, values: dict[str, nd.NDArray], filename: str) -> None:
    """Read the temporary file back: MXNet's writer ignores failed writes (a full disk
    leaves a short file and no error), and a short file must never replace a good one."""
    try:
        back = nd.load(tmp)
        whole = isinstance(back, dict) and {k: v.shape for k, v in back.items()} == {
            k: v.shape for k, v in values.items()
        }
    except mx.base.MXNetError:
        whole = False
    if not whole:
        raise OSError(
            f"saving {filename!r} failed: the parameter file was not written whole (is the "
            "disk full?); the previous file is left as it was"
        )


def check_shape(param: gluon.Parameter, value: nd.NDArray) -> None:
    """Refuse a saved value whose shape is not ``param``'s."""
    if tuple(value.shape) != tuple(param.shape):
        raise CheckpointError(
            f"parameter {param.name!r} has shape {param.shape} but the file holds "
            f"{value.shape}; load a checkpoint saved from the same net"
        )


def set_value(trainer: Trainer, param: gluon.Parameter, value: nd.NDArray) -> None:
    """Write ``value`` into ``param``'s master on every context, then cast it into ``param``."""
    check_shape(param, value)
    master = param if trainer.masters is None else trainer.masters.master_for(param)
    for target in master.list_data():
        cast_into(value.as_in_context(target.context), target)
    if master is not param:
        for data, source in zip(param.list_data(), master.list_data(), strict=True):
            trainer._write_model(source, data)


def load_parameters(
    trainer: Trainer,
    filename: str,
    ctx: Any = None,
    allow_missing: bool = False,
    ignore_extra: bool = False,
    cast_dtype: bool = False,
    dtype_source: str = "current",
) -> None:
    """Load a parameter file into the masters and the model (``Block.load_parameters``'s
    arguments; ``ctx``, ``cast_dtype`` and ``dtype_source`` only matter before the Trainer
    has initialised its parameters, when Gluon's own loader runs).

    Every name and shape is checked before the first parameter is written: a file refused
    with :class:`CheckpointError` leaves the model and the masters as they were.
    """
    loaded = _read_parameters(filename)
    params = _named_params(trainer)
    net = trainer._net
    if trainer.masters is None:
        # before the masters exist Gluon's own loader runs; it reads a file without dotted
        # names as a legacy one, under other names: check only what it checks by our names
        if net is None or any("." in name for name in loaded):
            _match(loaded, params, filename, allow_missing, ignore_extra)
        if net is not None:
            type(net).load_parameters(
                net, filename, ctx, allow_missing, ignore_extra, cast_dtype, dtype_source
            )
        else:
            gluon.ParameterDict.load(
                _as_dict(trainer),
                filename,
                ctx,
                allow_missing,
                ignore_extra,
                "",
                cast_dtype=cast_dtype,
                dtype_source=dtype_source,
            )
        return
    pairs = _match(loaded, params, filename, allow_missing, ignore_extra)
    for param, value in pairs:
        check_shape(param, value)
    for param, value in pairs:
        set_value(trainer, param, value)


def _read_parameters(filename: str) -> dict[str, nd.NDArray]:
    try:
        loaded = nd.load(filename)
    except mx.base.MXNetError as err:
        raise CheckpointError(
            f"{filename!r} is not a readable parameter file ({str(err).splitlines()[0]}); it "
            "is truncated or damaged: load an earlier checkpoint"
        ) from err
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{filename!r} holds a list of arrays, not named parameters")
    return loaded


def _match(
    loaded: dict[str, nd.NDArray],
    params: dict[str, gluon.Parameter],
    filename: str,
    allow_missing: bool,
    ignore_extra: bool,
) -> list[tuple[gluon.Parameter, nd.NDArray]]:
    """(parameter, saved value) pairs, after refusing missing and unknown names."""
    if not allow_missing:
        names = defaultdict(list)
        for name, param in params.items():
            names[id(param)].append(name)
        for name, param in params.items():
            if not any(n in loaded for n in names[id(param)]):
                raise CheckpointError(
                    f"parameter {name!r} is missing in {filename!r} (it holds "
                    f"{', '.join(sorted(loaded)[:6])}...); pass allow_missing=True to skip it"
                )
    extra = [name for name in loaded if name not in params]
    if extra and not ignore_extra:
        raise CheckpointError(
            f"{filename!r} holds parameter {extra[0]!r}, which this net does not have; pass "
            "ignore_extra=True to ignore it"
        )
    return [(params[name], value) for name, value in loaded.items() if name in params]


def _as_dict(trainer: Trainer) -> gluon.ParameterDict:
    params = gluon.ParameterDict()
    params.update({p.name: p for p in trainer._params})
    return params


def save_states(trainer: Trainer, filename: str) -> None:
    """Pickle the optimizer state, the loss-scaler state and the policy to ``filename``."""
    blob = {
        "format": STATES_FORMAT,
        "optimizer": trainer._updaters[0].get_states(dump_optimizer=True),
        "scaler": trainer.scaler.state_dict(),
        "policy": trainer.policy.to_dict(),
        "names": param_names(trainer),
    }
    if trainer._compensation is not None:  # the exact compensation and the random stream
        blob["compensation"] = trainer._compensation.state_dict(_names_by_id(trainer))
    atomic_write_bytes(filename, pickle.dumps(blob))


def load_states(trainer: Trainer, filename: str) -> None:
    """Restore what :func:`save_states` wrote into ``trainer`` (whose policy must match).

    The whole file is read and checked first (format, policy, loss-scaler state, optimizer
    state); a file refused with :class:`CheckpointError` changes nothing.
    """
    with open(filename, "rb") as f:
        raw = f.read()
    blob = _unpickle(raw, filename, "trainer states")
    scaler_state = None
    if isinstance(blob, dict) and blob.get("format") == STATES_FORMAT:
        missing = sorted({"optimizer", "scaler", "policy"} - set(blob))
        if missing:
            raise CheckpointError(
                f"{filename!r} is a mixprec states file without {missing}; it is damaged: "
                "save it again with trainer.save_states()"
            )
        try:
            saved = Policy.from_dict(blob["policy"])
        except (MixprecError, TypeError, ValueError, AttributeError) as err:
            raise CheckpointError(f"{filename!r} holds a malformed policy: {err}") from err
        if saved != trainer.policy:
            raise CheckpointError(
                f"{filename!r} was saved under policy {saved} but this Trainer runs "
                f"{trainer.policy}; build the Trainer with policy={str(saved)!r} to resume"
            )
        states = blob["optimizer"]
        scaler_state = blob["scaler"]
        # a probe takes the state first: a malformed one raises before the scaler changes
        LossScaler(trainer.scaler.state.fresh()).load_state_dict(scaler_state)
    else:
        warnings.warn(
            f"{filename!r} is a plain gluon.Trainer states file: the optimizer state is loaded "
            "but the loss scale starts afresh (trainer.save_states() also saves it)",
            MixprecWarning,
            stacklevel=3,
        )
        states = raw
    _check_optimizer_states(states, len(trainer._params), filename)
    if scaler_state is not None:  # a mixprec file: its optimizer state may need renumbering
        new_index = _new_indices(blob.get("names"), param_names(trainer))
        if new_index:
            states = _reindexed(states, new_index)
    compensation = trainer._compensation
    names = _names_by_id(trainer)
    if compensation is not None:
        compensation.check_state_dict(blob.get("compensation"), filename, names)
    if scaler_state is not None:
        trainer.scaler.load_state_dict(scaler_state)
    if compensation is not None:
        compensation.load_state_dict(blob["compensation"], names)
    for updater in trainer._updaters:
        updater.set_states(states)
        updater.optimizer = trainer._updaters[0].optimizer
    trainer._optimizer = trainer._updaters[0].optimizer
    trainer._optimizer.param_dict = dict(enumerate(trainer._params))


def param_names(trainer: Trainer) -> list[str]:
    """The name ``save_parameters`` keys each of the trainer's parameters by (``"0.weight"``),
    in the trainer's index order."""
    names = _names_by_id(trainer)
    return [names.get(id(p), p.name) for p in trainer._params]


def _names_by_id(trainer: Trainer) -> dict[int, str]:
    first: dict[int, str] = {}
    for name, param in _named_params(trainer).items():
        first.setdefault(id(param), name)  # a shared parameter keeps its first name
    return first


def _new_indices(saved: Any, current: list[str]) -> dict[int, int] | None:
    """``{saved index: index here}`` when the same parameters are numbered differently here
    (``gluon.Trainer`` sorts them by global names, which differ between two nets of one
    architecture built in one process); None when nothing moves or the names do not match."""
    if not isinstance(saved, list) or sorted(saved) != sorted(current) or saved == current:
        return None
    here = {name: i for i, name in enumerate(current)}
    return {i: here[name] for i, name in enumerate(saved)}


def _reindexed(states: bytes, new_index: dict[int, int]) -> bytes:
    """Optimizer state (``Updater.get_states`` bytes, checked) with its per-parameter states
    and update counts moved to the indices this trainer gives the same parameters."""
    inner = pickle.loads(states)
    if isinstance(inner, tuple):
        per_param, optimizer = inner
        reindex_update_counts(optimizer, new_index)
        return pickle.dumps(({new_index.get(k, k): v for k, v in per_param.items()}, optimizer))
    return pickle.dumps({new_index.get(k, k): v for k, v in inner.items()})


def _unpickle(raw: bytes, filename: str, what: str) -> Any:
    try:
        return pickle.loads(raw)
    except Exception as err:  # a damaged pickle raises anything from EOFError to KeyError
        raise CheckpointError(
            f"{filename!r} is not a readable {what} file ({type(err).__name__}: {err}); it is "
            "truncated or damaged: load an earlier checkpoint"
        ) from err


def _check_optimizer_states(states: Any, count: int, filename: str) -> None:
    """Refuse optimizer state that ``Updater.set_states`` would choke on, before any change."""
    if not isinstance(states, bytes):
        raise CheckpointError(
            f"{filename!r} holds optimizer state of type {type(states).__name__}, not the "
            "bytes Updater.get_states() returns; save it again with trainer.save_states()"
        )
    inner = _unpickle(states, filename, "optimizer state")
    if isinstance(inner, tuple) and len(inner) == 2:
        inner, optimizer = inner
        if not isinstance(optimizer, mx.optimizer.Optimizer):
            raise CheckpointError(
                f"{filename!r} holds a {type(optimizer).__name__} where the optimizer should "
                "be; save it again with trainer.save_states()"
            )
    if not isinstance(inner, dict):
        raise CheckpointError(
            f"{filename!r} holds optimizer state of type {type(inner).__name__}, not a dict "
            "of per-parameter states; save it again with trainer.save_states()"
        )
    unknown = sorted(k for k in inner if not isinstance(k, int) or not 0 <= k < count)
    if unknown:
        raise CheckpointError(
            f"{filename!r} holds optimizer state for parameter indices {unknown[:6]}, but this "
            f"Trainer has {count} parameters; load states saved by a Trainer over the same net"
        )
