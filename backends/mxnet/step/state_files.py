"""Trainer-state files that hold data, never code: the format ``save_states`` writes.

``mixprec-mxnet-states/3`` is one MXNet NDArray file (``nd.save``: named arrays, parsed by
MXNet's own loader, no pickle). Its entry ``__mixprec__`` is a ``uint8`` array holding UTF-8
JSON: the format name, the policy, the loss-scaler state, the parameters' names, the
optimizer's class name and its plain settings (numbers, strings, the per-parameter update
counts, the learning-rate schedule's counters) and, under ``master=kahan|stochastic``, the
strategy and its random stream. The optimizer's per-parameter states (arrays, or tuples of
them) are entries ``optimizer/<index>/<position>``; the kahan compensation is
``compensation/<name>``. Under a low-bit ``state`` (``int8``, ``int4``, ``fp8``) a quantized
state array is kept as it is between steps: its description names the format and block size
(``"int8/256"``), the map (signed or not) and the shape, and its codes and block absmax are
the entries ``optimizer/<index>/<position>/codes`` and ``.../absmax``
(:mod:`~..lowbit.state`). Such a file is refused as damaged by a mixprec without low-bit
states, which could not train on it.

The file ends with a checksum line, ``\\nmixprec-sha256:<64 hex digits>\\n``: the SHA-256 of
every byte before it (the NDArray file, header and arrays). MXNet's loader ignores bytes after
the arrays, so ``nd.load`` still reads the file; :func:`read_states` checks the checksum
before MXNet parses anything, so a flipped byte anywhere (a length, a shape, a name, a number)
is refused with :class:`~mixprec.errors.CheckpointError` instead of loading changed numbers or
reaching MXNet's parser. Files of the previous version, ``mixprec-mxnet-states/2`` (the same
layout without the checksum line), still load: MXNet parses them unverified, and the loader's
checks (names, shapes, dtypes, finiteness) are all that stands between a damaged one and the
optimizer. A ``/3`` header without its checksum line is refused (a truncated file).

Loading builds nothing but plain data and arrays: the optimizer object that trains is the
Trainer's own, which receives the saved settings only where it already has a setting of that
name and kind, and a schedule only when it has one of the same class.

Older files are pickles: mixprec's ``mixprec-mxnet-states/1`` and plain ``gluon.Trainer``
states. They load through :class:`_Unpickler`, which turns every class a pickle names into an
inert record (its name and its saved attributes) and allows no other callable than
``bytearray`` and NumPy's array/scalar rebuilders; only MXNet optimizer and learning-rate
schedule classes, NumPy arrays and MXNet arrays may appear at all. The arrays are then read by
MXNet's raw-bytes loader. So no file, old or new, can make mixprec run code.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import pickle
import re
from collections.abc import Mapping
from typing import Any

import mxnet as mx
import numpy as np
import numpy.typing as npt
from mxnet import nd

from mixprec.errors import CheckpointError

from ..gluon_private import update_counts
from ..lowbit.state import LowBitArray

__all__ = [
    "FORMAT",
    "FORMAT_V2",
    "LEGACY_FORMAT",
    "SavedStates",
    "decode_state",
    "encode_state",
    "optimizer_record",
    "read_states",
    "seal",
    "states_arrays",
]

FORMAT = "mixprec-mxnet-states/3"
#: The previous version: the same layout without the checksum line; still loaded.
FORMAT_V2 = "mixprec-mxnet-states/2"
_CHECKSUM = re.compile(rb"\nmixprec-sha256:([0-9a-f]{64})\n\Z")
_CHECKSUM_LEN = len(b"\nmixprec-sha256:\n") + 64
LEGACY_FORMAT = "mixprec-mxnet-states/1"
META = "__mixprec__"
_MAX_DEPTH = 8
_PRIMITIVE = (bool, int, float, str, type(None))


@dataclasses.dataclass
class SavedStates:
    """A states file as data: ``meta`` (the JSON part), the optimizer's per-parameter states
    by index and the kahan compensation by parameter name. ``kind``: ``"mixprec"`` (this
    format or its pickled predecessor) or ``"gluon"`` (a plain ``gluon.Trainer`` file: no
    policy, no loss scale)."""

    meta: dict[str, Any]
    per_param: dict[int, Any]
    compensation: dict[str, npt.NDArray[Any]]
    kind: str = "mixprec"


# ---------------------------------------------------------------------- writing


def encode_state(value: Any, key: str, arrays: dict[str, nd.NDArray]) -> Any:
    """The JSON description of one parameter's optimizer state; its arrays go to ``arrays``."""
    if value is None:
        return None
    if isinstance(value, nd.NDArray):
        arrays[key] = value.copyto(mx.cpu())
        return {"array": key}
    if isinstance(value, LowBitArray):  # state=int8|int4|fp8: the codes, as kept
        arrays[f"{key}/codes"] = value.codes.copyto(mx.cpu())
        arrays[f"{key}/absmax"] = value.absmax.copyto(mx.cpu())
        return {
            "lowbit": {
                "format": value.tag,
                "signed": value.signed,
                "shape": list(value.shape),
                "codes": f"{key}/codes",
                "absmax": f"{key}/absmax",
            }
        }
    if isinstance(value, (tuple, list)):
        kind = "tuple" if isinstance(value, tuple) else "list"
        return {kind: [encode_state(v, f"{key}/{i}", arrays) for i, v in enumerate(value)]}
    raise CheckpointError(
        f"the optimizer keeps a {type(value).__name__} in its per-parameter state, which "
        "mixprec's states file cannot hold (arrays, tuples and lists of them, or None)"
    )


def _plain(value: Any) -> Any:
    """``value`` as JSON-able plain data (numbers, strings, lists, string-keyed dicts), or
    :data:`_SKIP` where it holds anything else."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, _PRIMITIVE):
        return value
    if isinstance(value, (list, tuple)):
        seq = [_plain(v) for v in value]
        return _SKIP if any(v is _SKIP for v in seq) else seq
    if isinstance(value, Mapping):
        named = {str(k): _plain(v) for k, v in value.items() if isinstance(k, (str, int))}
        return _SKIP if any(v is _SKIP for v in named.values()) else named
    return _SKIP


_SKIP = object()


def _fields(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """The public plain-data attributes of an object's ``__dict__``."""
    out = {}
    for name, value in attrs.items():
        if not isinstance(name, str) or name.startswith("_") or name == "param_dict":
            continue
        plain = _plain(value)
        if plain is not _SKIP:
            out[name] = plain
    return out


def _record(class_name: str, attrs: Mapping[str, Any], counts: Any) -> dict[str, Any]:
    scheduler = attrs.get("lr_scheduler")
    schedule = None
    if scheduler is not None:
        schedule = {"class": _class_name(scheduler), "fields": _fields(_attrs(scheduler))}
    plain_counts = _plain(counts) if counts is not None else {}
    return {
        "class": class_name,
        "fields": _fields(attrs),
        "counts": plain_counts if isinstance(plain_counts, dict) else {},
        "scheduler": schedule,
    }


def optimizer_record(optimizer: Any) -> dict[str, Any]:
    """An optimizer's settings as plain data: class name, public settings, per-parameter
    update counts (``{device: {index: count}}``) and its learning-rate schedule's."""
    return _record(type(optimizer).__name__, vars(optimizer), update_counts(optimizer))


def states_arrays(
    meta: dict[str, Any],
    per_param: Mapping[int, Any],
    compensation: Mapping[str, nd.NDArray],
) -> dict[str, nd.NDArray]:
    """The named arrays of a states file (``nd.save`` writes them): the header as JSON in a
    ``uint8`` array, the optimizer's per-parameter states, the compensation."""
    arrays: dict[str, nd.NDArray] = {}
    meta = dict(meta, format=FORMAT)
    meta["per_param"] = {
        str(i): encode_state(state, f"optimizer/{i}", arrays) for i, state in per_param.items()
    }
    for name, comp in compensation.items():
        arrays[f"compensation/{name}"] = comp.copyto(mx.cpu())
    raw = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
    blob = nd.empty(raw.shape, dtype=np.uint8)
    blob[:] = raw
    arrays[META] = blob
    return arrays


def seal(body: bytes) -> bytes:
    """The checksum line for a states file whose bytes so far are ``body``."""
    return b"\nmixprec-sha256:" + hashlib.sha256(body).hexdigest().encode("ascii") + b"\n"


# ---------------------------------------------------------------------- reading


def _damaged(filename: str, why: str) -> CheckpointError:
    return CheckpointError(
        f"{filename!r} is not a readable trainer states file ({why}); it is truncated or "
        "damaged: load an earlier checkpoint, or save it again with trainer.save_states()"
    )


def read_states(raw: bytes, filename: str) -> SavedStates:
    """Parse a states file's bytes (this format or a legacy pickle) into :class:`SavedStates`.

    :raises CheckpointError: anything malformed, naming the file; nothing has changed then.
    """
    sealed = _CHECKSUM.search(raw[-_CHECKSUM_LEN:])
    if sealed is not None:
        body = raw[:-_CHECKSUM_LEN]
        if hashlib.sha256(body).hexdigest().encode("ascii") != sealed.group(1):
            raise _damaged(filename, "its SHA-256 checksum does not match its contents")
        raw = body
    elif raw[:1] == b"\x80":  # a pickle: mixprec's states/1 or a plain gluon.Trainer file
        return _read_legacy(raw, filename)
    try:
        loaded = nd.load_frombuffer(raw)
    except (mx.base.MXNetError, ValueError, MemoryError) as err:  # names: UnicodeDecodeError
        raise _damaged(filename, str(err).splitlines()[0] if str(err) else repr(err)) from err
    if not isinstance(loaded, dict) or META not in loaded:
        raise _damaged(filename, "no mixprec header")
    try:
        meta = json.loads(loaded.pop(META).asnumpy().astype(np.uint8).tobytes().decode("utf-8"))
    except (ValueError, RecursionError, mx.base.MXNetError) as err:
        raise _damaged(filename, f"header: {err}") from err
    found = meta.get("format") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or found not in (FORMAT, FORMAT_V2):
        raise _damaged(filename, f"format {found!r}, expected {FORMAT!r}")
    if found == FORMAT and sealed is None:  # /3 always ends with its checksum line
        raise _damaged(filename, f"format {found!r} without its checksum line")
    per_param_spec = meta.pop("per_param", None)
    if not isinstance(per_param_spec, dict):
        raise _damaged(filename, "no optimizer state")
    per_param = {
        _index(k, filename): decode_state(spec, loaded, filename)
        for k, spec in per_param_spec.items()
    }
    prefix = "compensation/"
    compensation = {
        k[len(prefix) :]: v.asnumpy() for k, v in loaded.items() if k.startswith(prefix)
    }
    for name, values in compensation.items():
        if not np.isfinite(values).all():
            raise CheckpointError(
                f"{filename!r} holds an inf or NaN in the compensation of {name!r}; loaded, "
                "it would reach the weights at the next step. The file is damaged: load an "
                "earlier checkpoint (nothing was loaded)"
            )
    return SavedStates(meta, per_param, compensation)


def _index(key: Any, filename: str) -> int:
    try:
        return int(key)
    except (TypeError, ValueError):
        raise _damaged(filename, f"optimizer state keyed {key!r}") from None


def decode_state(spec: Any, arrays: Mapping[str, nd.NDArray], filename: str, depth: int = 0) -> Any:
    """One parameter's optimizer state from its JSON description and the file's arrays."""
    if depth > _MAX_DEPTH:
        raise _damaged(filename, "optimizer state nested too deeply")
    if spec is None:
        return None
    if isinstance(spec, dict) and len(spec) == 1:
        ((kind, value),) = spec.items()
        if kind == "array" and isinstance(value, str) and value in arrays:
            return arrays[value]
        if kind == "lowbit":
            return _lowbit(value, arrays, filename)
        if kind in ("tuple", "list") and isinstance(value, list):
            items = [decode_state(v, arrays, filename, depth + 1) for v in value]
            return tuple(items) if kind == "tuple" else items
    raise _damaged(filename, f"optimizer state {str(spec)[:60]}")


_LOWBIT_KEYS = {"format", "signed", "shape", "codes", "absmax"}


def _lowbit(spec: Any, arrays: Mapping[str, nd.NDArray], filename: str) -> LowBitArray:
    """A quantized state array from its description; whether it fits its parameter and the
    Trainer's format is :func:`~..lowbit.state.check_saved`'s business."""
    fits = isinstance(spec, dict) and set(spec) == _LOWBIT_KEYS
    if fits:
        shape = spec["shape"]
        fits = (
            isinstance(spec["format"], str)
            and isinstance(spec["signed"], bool)
            and isinstance(shape, list)
            and len(shape) <= _MAX_DEPTH
            and all(type(n) is int and n >= 0 for n in shape)
            and all(isinstance(spec[k], str) and spec[k] in arrays for k in ("codes", "absmax"))
        )
    if not fits:
        raise _damaged(filename, f"quantized optimizer state {str(spec)[:60]}")
    return LowBitArray(
        arrays[spec["codes"]], arrays[spec["absmax"]], spec["shape"], spec["signed"], spec["format"]
    )


# ---------------------------------------------------------------------- legacy pickles


class _Record:
    """An object a legacy pickle names, kept as inert data: no method of its class runs."""

    module = ""
    name = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Record:
        return object.__new__(cls)

    def __setstate__(self, state: Any) -> None:
        self.saved = state


class _ArrayRecord(_Record):
    """An ``NDArray`` of a legacy pickle: its raw bytes, read by MXNet's loader afterwards."""


_NUMPY_REBUILDERS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
}


def _known_class(module: str, name: str) -> bool:
    """An MXNet optimizer class (built-in or registered) or learning-rate schedule class."""
    candidates = list(mx.optimizer.Optimizer.opt_registry.values())
    candidates += [
        cls
        for cls in vars(mx.lr_scheduler).values()
        if isinstance(cls, type) and issubclass(cls, mx.lr_scheduler.LRScheduler)
    ]
    return any(c.__module__ == module and c.__qualname__ == name for c in candidates)


class _Unpickler(pickle.Unpickler):
    """Unpickles plain data only: see the module docstring."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "bytearray"):
            return bytearray
        if (module, name) in _NUMPY_REBUILDERS:
            return super().find_class(module, name)
        if (module, name) == ("mxnet.ndarray.ndarray", "NDArray"):
            return _ArrayRecord
        if _known_class(module, name):
            return type(name, (_Record,), {"module": module, "name": name})
        raise _Refused(f"{module}.{name}")


class _Refused(pickle.UnpicklingError):
    """A legacy pickle names something other than data."""


def _unpickle(raw: bytes, filename: str) -> Any:
    try:
        return _Unpickler(io.BytesIO(raw)).load()
    except _Refused as err:
        raise CheckpointError(
            f"{filename!r} names {err}, which mixprec never loads from a states file (it "
            "holds only arrays, optimizer and schedule settings): mixprec and gluon.Trainer "
            "did not write it, and it was not loaded. Load a file you saved yourself"
        ) from None
    except Exception as err:  # a damaged pickle raises anything from EOFError to KeyError
        raise _damaged(filename, f"{type(err).__name__}: {err}") from err


def _array(record: _ArrayRecord, filename: str) -> nd.NDArray:
    state = getattr(record, "saved", None)
    buf = state.get("handle") if isinstance(state, dict) else None
    if not isinstance(buf, (bytes, bytearray)):
        raise _damaged(filename, "an array without data")
    try:
        array = nd.NDArray.__new__(nd.NDArray)
        array.__setstate__({"handle": bytearray(buf)})  # MXNDArrayLoadFromRawBytes
    except mx.base.MXNetError as err:
        raise _damaged(filename, f"array: {err}") from err
    return array


def _legacy_state(value: Any, filename: str, depth: int = 0) -> Any:
    if depth > _MAX_DEPTH:
        raise _damaged(filename, "optimizer state nested too deeply")
    if value is None:
        return None
    if isinstance(value, _ArrayRecord):
        return _array(value, filename)
    if isinstance(value, (tuple, list)):
        items = [_legacy_state(v, filename, depth + 1) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    raise _damaged(filename, f"optimizer state of type {type(value).__name__}")


def _attrs(obj: Any) -> dict[str, Any]:
    if isinstance(obj, _Record):
        saved = getattr(obj, "saved", None)
        return dict(saved) if isinstance(saved, dict) else {}
    return dict(vars(obj))


def _class_name(obj: Any) -> str:
    return obj.name if isinstance(obj, _Record) else type(obj).__name__


def _read_legacy(raw: bytes, filename: str) -> SavedStates:
    blob = _unpickle(raw, filename)
    kind, meta = "gluon", {}
    optimizer_bytes: Any = raw
    if isinstance(blob, dict) and blob.get("format") == LEGACY_FORMAT:
        kind = "mixprec"
        missing = sorted({"optimizer", "scaler", "policy"} - set(blob))
        if missing:
            raise CheckpointError(
                f"{filename!r} is a mixprec states file without {missing}; it is damaged: "
                "save it again with trainer.save_states()"
            )
        meta = {k: blob[k] for k in ("policy", "scaler", "names") if k in blob}
        optimizer_bytes = blob["optimizer"]
        if not isinstance(optimizer_bytes, (bytes, bytearray)):
            raise CheckpointError(
                f"{filename!r} holds optimizer state of type {type(optimizer_bytes).__name__}, "
                "not the bytes Updater.get_states() returns; save it again with "
                "trainer.save_states()"
            )
        optimizer_bytes = bytes(optimizer_bytes)
    inner = blob if kind == "gluon" else _unpickle(optimizer_bytes, filename)
    optimizer = None
    if isinstance(inner, tuple) and len(inner) == 2:
        inner, optimizer = inner
        if not isinstance(optimizer, _Record):
            raise CheckpointError(
                f"{filename!r} holds a {type(optimizer).__name__} where the optimizer should "
                "be; save it again with trainer.save_states()"
            )
    if not isinstance(inner, dict):
        raise CheckpointError(
            f"{filename!r} holds optimizer state of type {type(inner).__name__}, not a dict "
            "of per-parameter states; save it again with trainer.save_states()"
        )
    per_param = {k: _legacy_state(v, filename) for k, v in inner.items()}
    if optimizer is not None:
        attrs = _attrs(optimizer)
        meta["optimizer"] = _record(optimizer.name, attrs, attrs.get("_all_index_update_counts"))
    compensation: dict[str, npt.NDArray[Any]] = {}
    if kind == "mixprec" and "compensation" in blob:
        saved = blob["compensation"]
        if isinstance(saved, dict):
            comps = saved.get("compensation", {})
            meta["compensation"] = {k: v for k, v in saved.items() if k != "compensation"}
            if isinstance(comps, dict):
                compensation = {str(k): v for k, v in comps.items() if isinstance(v, np.ndarray)}
    return SavedStates(meta, per_param, compensation, kind)
