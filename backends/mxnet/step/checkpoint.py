"""Saving and loading parameters as float32 master values (trainer states: :mod:`.states`).

- ``net.save_parameters(f)`` (patched on the net the Trainer converted) and
  ``trainer.save_parameters(f)`` write every parameter in float32: the master where the
  model holds a low-precision copy, else the parameter itself (bfloat16/float16 values
  upcast exactly). The file is an ordinary Gluon parameter file.
- ``net.load_parameters(f)`` / ``trainer.load_parameters(f)`` write the saved values into
  the masters first, then cast them into the model (round to nearest-even), so a resumed run
  continues from exactly the values an uninterrupted run had.
- Both files are written atomically (:mod:`mixprec.atomic`: a temporary file in the same
  folder, fsync, rename): a save killed or failing half-way leaves the previous file whole.
- Every load reads and checks the whole file (names and shapes) before it changes anything:
  a file refused with :class:`~mixprec.errors.CheckpointError` leaves the net and the
  masters as they were, also before the Trainer has made its masters (Gluon's own loader
  runs then, and would stop half-way at a wrong shape).
- Under ``master=kahan`` the float32 value saved for a bfloat16 weight is ``w + c``, the
  best the strategy knows; loading it splits it again (:mod:`~..compensated.compensation`).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import mxnet as mx
from mxnet import gluon, nd

from mixprec.errors import CheckpointError
from mixprec.kit import atomic_path

from ..dtypes import cast_into
from .protocol import write_model
from .trainer_state import TrainerState, float32_value, named_params, trainer_state

__all__ = ["check_written", "load_parameters", "patch_net", "save_arrays", "save_parameters"]


def patch_net(net: gluon.Block, trainer: gluon.Trainer) -> None:
    """Make ``net.save_parameters``/``load_parameters`` go through ``trainer`` (this net only)."""
    net.save_parameters = functools.partial(save_parameters, trainer)
    net.load_parameters = functools.partial(load_parameters, trainer)


def save_parameters(trainer: gluon.Trainer, filename: str, deduplicate: bool = False) -> None:
    """Write the parameters as float32 values, keyed like ``Block.save_parameters``."""
    st = trainer_state(trainer)
    params = named_params(st)
    if deduplicate:
        first = {id(p): name for name, p in reversed(list(params.items()))}
        params = {name: p for name, p in params.items() if first[id(p)] == name}
    values = {name: float32_value(st, p) for name, p in params.items()}
    with atomic_path(filename) as tmp:
        save_arrays(tmp, values, filename)


def save_arrays(tmp: str, values: Mapping[str, nd.NDArray], filename: str) -> None:
    """``nd.save`` into the temporary file ``tmp`` of an atomic save of ``filename``, then
    read it back (:func:`check_written`); a failed write is an ``OSError``."""
    try:
        nd.save(tmp, dict(values))
    except mx.base.MXNetError as err:
        raise OSError(
            f"saving {filename!r} failed ({str(err).splitlines()[-1].strip()}); the previous "
            "file is left as it was"
        ) from err
    check_written(tmp, values, filename)


def check_written(tmp: str, values: Mapping[str, nd.NDArray], filename: str) -> None:
    """Read the temporary file back: MXNet's writer ignores some failed writes (a full disk
    can leave a short file and no error), and a short file must never replace a good one."""
    try:
        back = nd.load(tmp)
        whole = isinstance(back, dict) and {k: v.shape for k, v in back.items()} == {
            k: v.shape for k, v in values.items()
        }
    except mx.base.MXNetError:
        whole = False
    if not whole:
        raise OSError(
            f"saving {filename!r} failed: the file was not written whole (is the "
            "disk full?); the previous file is left as it was"
        )


def check_shape(param: gluon.Parameter, value: nd.NDArray, name: str | None = None) -> None:
    """Refuse a saved value whose shape is not ``param``'s (a deferred parameter's unknown
    dimensions, 0, match any size); ``name``: the file's name for it."""
    shape, saved = tuple(param.shape or ()), tuple(value.shape)
    if len(shape) != len(saved) or any(d not in (0, s) for d, s in zip(shape, saved, strict=True)):
        raise CheckpointError(
            f"parameter {name or param.name!r} has shape {param.shape} but the file holds "
            f"{value.shape}; load a checkpoint saved from the same net"
        )


def set_value(st: TrainerState, param: gluon.Parameter, value: nd.NDArray) -> None:
    """Write ``value`` into ``param``'s master on every context, then cast it into ``param``."""
    check_shape(param, value)
    master = param if st.masters is None else st.masters.master_for(param)
    for target in master.list_data():
        cast_into(value.as_in_context(target.context), target)
    if master is not param:
        for data, source in zip(param.list_data(), master.list_data(), strict=True):
            write_model(st, source, data)


def load_parameters(
    trainer: gluon.Trainer,
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
    st = trainer_state(trainer)
    loaded = _read_parameters(filename)
    params = named_params(st)
    net = st.net
    if st.masters is None:
        # before the masters exist Gluon's own loader runs; it reads a file without dotted
        # names as a legacy one, under other names: check only what it checks by our names
        if net is None or any("." in name for name in loaded):
            for name, param, value in _match(loaded, params, filename, allow_missing, ignore_extra):
                check_shape(param, value, name)  # Gluon's loader would stop half-way
        if net is not None:
            type(net).load_parameters(
                net, filename, ctx, allow_missing, ignore_extra, cast_dtype, dtype_source
            )
        else:
            gluon.ParameterDict.load(
                _as_dict(st),
                filename,
                ctx,
                allow_missing,
                ignore_extra,
                "",
                cast_dtype=cast_dtype,
                dtype_source=dtype_source,
            )
        return
    found = _match(loaded, params, filename, allow_missing, ignore_extra)
    for name, param, value in found:
        check_shape(param, value, name)
    for _, param, value in found:
        set_value(st, param, value)


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
) -> list[tuple[str, gluon.Parameter, nd.NDArray]]:
    """(name, parameter, saved value) triples, after refusing missing and unknown names."""
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
    return [(name, params[name], value) for name, value in loaded.items() if name in params]


def _as_dict(st: TrainerState) -> gluon.ParameterDict:
    params = gluon.ParameterDict()
    params.update({p.name: p for p in st.params})
    return params
