"""Checkpoints: the state pytree as one ``.npz`` file, every array exact, read defensively.

A :class:`~mixprec_jax.state.State` is a pytree of arrays, so a plain
``numpy.savez(file, *jax.tree_util.tree_leaves(state))`` already keeps everything a
resumed run needs (weights, optax state, loss scale, counters, compensation, the rounding
key). :func:`save` does that with named entries and a header: the entry ``__meta__`` holds
UTF-8 JSON with the format, the policy, each array's dtype and two SHA-256 checksums (one
over the header itself, one over every array's name, dtype, shape and bytes). NumPy has no
bfloat16, so bfloat16 arrays travel as their raw ``uint16`` bits and are viewed back (bit
for bit). Files are written atomically (:mod:`mixprec.atomic`).

:func:`load` reads a file as untrusted data and checks before it builds anything, so a
refused file changes nothing and every refusal is a :class:`~mixprec.errors.CheckpointError`
that names the problem and what to do:

- the file's size, then each zip member's declared size (from the zip's central directory,
  before anything is inflated) against what the state it is loaded into can need: a total
  cap and a cap per member derived from that state's arrays, so a zip bomb is refused
  unread; reads are bounded by the declared sizes, so a member that lies about its size
  fails its CRC instead of filling memory;
- what the file is, when it is not a mixprec-jax checkpoint: a Gluon states or ``.params``
  file, a PyTorch checkpoint, a pickle, a single ``.npy`` array, a plain ``numpy.savez``, a
  :func:`save_params` file, an empty or truncated file (nothing is ever unpickled);
- the header's checksum, the policy, the arrays' names, dtypes and shapes against ``like``;
- the arrays' checksum: a flipped byte anywhere in the header or the data is refused;
- inf and NaN values: loaded, they would reach the weights at the next step, which the
  step's guard cannot see (it checks gradients). A leaf whose value in ``like`` itself holds
  inf or NaN (an optax state that starts at ``inf``, like ``reduce_on_plateau``'s best
  value) may hold them in the file too.

Files of the first format (``mixprec-jax/1``, written before the checksums) still load: the
same checks except the two checksums.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import struct
import zipfile
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import IO, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt

from mixprec.errors import CheckpointError, MixprecError
from mixprec.kit import Policy, atomic_path
from mixprec_jax.casting import PyTree
from mixprec_jax.state import State
from mixprec_jax.trees import leaf_names

__all__ = ["FORMAT", "LEGACY_FORMATS", "load", "save", "save_params"]

FORMAT = "mixprec-jax/2"
LEGACY_FORMATS = ("mixprec-jax/1",)
_META = "__meta__"
#: The bytes one member's ``.npy`` header may take (NumPy writes 128 for a few dimensions).
NPY_HEADER_CAP = 4096
#: The header entry's cap: the policy and the format (this much), plus per array its name
#: and dtype (:func:`_meta_cap`).
META_BASE_CAP = 64 * 1024
#: A zip member's own records (local header, central directory entry, zip64 extras), besides
#: its name, and the archive's end records and comment.
_ZIP_MEMBER_OVERHEAD = 256
_ZIP_END_OVERHEAD = 64 * 1024 + 128
#: The prefix read to tell other formats apart (never parsed beyond a search for names).
_SNIFF = 64 * 1024
_CHUNK = 16 * 1024 * 1024
#: What parsing a damaged zip or .npy can raise, besides CheckpointError.
_PARSE_ERRORS = (
    OSError,
    EOFError,
    ValueError,
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    NotImplementedError,
    RuntimeError,
    zlib.error,
    struct.error,
    OverflowError,
    KeyError,
    IndexError,
    TypeError,
    AttributeError,
    SyntaxError,
    RecursionError,
)
#: What reading a header's policy can raise: a JSON integer past a float's range (a loss
#: scale of 10**400) is an OverflowError.
_POLICY_ERRORS = (
    MixprecError,
    KeyError,
    TypeError,
    ValueError,
    AttributeError,
    OverflowError,
)
#: numpy.lib.format, untyped here: NumPy 1's stubs lack the ``max_header_size`` it is called with
_NPY: Any = np.lib.format
_DAMAGED = "the file is damaged: load an earlier checkpoint (nothing was loaded)"


# ---------------------------------------------------------------------- writing


def _raw_dtype(dtype: Any) -> np.dtype[Any]:
    """The dtype an array of ``dtype`` is stored as: NumPy's own, or unsigned integers of
    the same width for the dtypes NumPy cannot describe (bfloat16 and the other ml_dtypes)."""
    d = np.dtype(dtype)
    return np.dtype(f"<u{d.itemsize}") if d.kind == "V" else d


def _arrays(tree: PyTree) -> tuple[dict[str, npt.NDArray[Any]], dict[str, str]]:
    arrays, dtypes = {}, {}
    for name, leaf in zip(leaf_names(tree), jax.tree_util.tree_leaves(tree), strict=True):
        value = np.asarray(jax.device_get(leaf))
        dtypes[name] = str(jnp.dtype(value.dtype))
        arrays[name] = value.view(_raw_dtype(value.dtype))
    return arrays, dtypes


def _canonical(meta: Mapping[str, Any]) -> bytes:
    header = {key: value for key, value in meta.items() if key != "sha256"}
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode()


def _arrays_digest(arrays: Mapping[str, npt.NDArray[Any]]) -> str:
    """SHA-256 over every array's name, stored dtype, shape and bytes (C order)."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        value = np.ascontiguousarray(arrays[name])
        digest.update(f"\0{name}\0{value.dtype.str}\0{list(value.shape)}\0".encode())
        digest.update(value.reshape(-1).data)
    return digest.hexdigest()


def _write(file: str | IO[bytes], arrays: dict[str, Any], meta: dict[str, Any]) -> None:
    meta = {**meta, "format": FORMAT}
    meta["sha256"] = {
        "header": hashlib.sha256(_canonical(meta)).hexdigest(),
        "arrays": _arrays_digest(arrays),
    }
    header = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    payload = {**arrays, _META: header}
    if isinstance(file, str | os.PathLike):
        with atomic_path(file, suffix=".npz") as tmp:
            np.savez(tmp, **payload)
        return
    np.savez(file, **payload)


def save(file: str | IO[bytes], state: State, policy: Policy) -> None:
    """Write every array of ``state``, the policy and the checksums (see the module
    docstring)."""
    arrays, dtypes = _arrays(state)
    _write(file, arrays, {"kind": "state", "policy": policy.to_dict(), "dtypes": dtypes})


def save_params(file: str | IO[bytes], params: PyTree, policy: Policy) -> None:
    """Write the parameters for inference: low-precision values a strategy keeps are
    widened to float32 (exact), so the file holds what the optimizer knows."""
    if policy.master_strategy is not None:
        params = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), params)
    arrays, dtypes = _arrays(params)
    _write(file, arrays, {"kind": "params", "policy": policy.to_dict(), "dtypes": dtypes})


# ---------------------------------------------------------------------- reading


class _Expected(NamedTuple):
    """One array the state being loaded needs."""

    name: str
    dtype: str  # the logical dtype ("bfloat16")
    raw: np.dtype[Any]  # as stored
    shape: tuple[int, ...]

    @property
    def cap(self) -> int:
        return math.prod(self.shape) * self.raw.itemsize + NPY_HEADER_CAP


def _expected(name: str, leaf: Any) -> _Expected:
    dtype = jnp.dtype(leaf.dtype)
    return _Expected(name, str(dtype), _raw_dtype(dtype), tuple(int(n) for n in leaf.shape))


def _meta_cap(expected: Mapping[str, _Expected]) -> int:
    # legacy files store the JSON as a NumPy unicode string: 4 bytes a character
    text = META_BASE_CAP + sum(len(name) + 64 for name in expected)
    return 4 * text + NPY_HEADER_CAP


def _label(file: object) -> str:
    return repr(os.fspath(file)) if isinstance(file, str | os.PathLike) else "the file"


def _size_of(fp: IO[bytes]) -> int:
    start = fp.tell()
    end = fp.seek(0, io.SEEK_END)
    fp.seek(start)
    return end - start


@contextmanager
def _opened(file: str | IO[bytes], label: str, limit: int) -> Iterator[tuple[IO[bytes], int]]:
    """The file, seekable, and its size (a stream is read up to ``limit + 1`` bytes)."""
    if isinstance(file, str | os.PathLike):
        try:
            fp: IO[bytes] = open(file, "rb")  # closed below
        except OSError as exc:
            raise CheckpointError(
                f"cannot open the checkpoint {label}: {exc.strerror or exc}; pass the path "
                "Optimizer.save wrote"
            ) from None
        with fp:
            yield fp, os.fstat(fp.fileno()).st_size
        return
    try:
        seekable = file.seekable()
    except (AttributeError, OSError, ValueError):
        seekable = False
    if seekable:
        yield file, _size_of(file)
        return
    parts, size = [], 0
    while size <= limit:  # a pipe may return less than asked: read to its end or the cap
        part = file.read(min(limit + 1 - size, _CHUNK))
        if not part:
            break
        parts.append(part)
        size += len(part)
    yield io.BytesIO(b"".join(parts)), size


def _not_a_checkpoint(label: str, what: str, fix: str) -> CheckpointError:
    return CheckpointError(f"{label} is {what}, not a mixprec-jax checkpoint; {fix}")


def _identify(head: bytes, label: str, size: int) -> None:
    """Refuse a file that is not a zip archive, naming what it is."""
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return
    if size == 0:
        raise CheckpointError(
            f"{label} is empty (0 bytes): the save that wrote it did not finish; load the "
            "checkpoint the last complete Optimizer.save wrote"
        )
    never = "mixprec-jax reads only the .npz files Optimizer.save writes and never unpickles"
    if head.startswith(b"\x12\x01\x00\x00\x00\x00\x00\x00"):  # MXNet's NDArray-list magic
        if b"mixprec-mxnet-states" in head:
            what = "a Gluon states file of mixprec.mxnet (Trainer.save_states)"
        else:
            what = "an MXNet NDArray file (a Gluon .params file or nd.save)"
        fix = "load it with mixprec.mxnet (Trainer.load_states, net.load_parameters)"
        raise _not_a_checkpoint(label, what, f"{fix}; {never}")
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        if b"mxnet" in head:
            what = "a pickled Gluon states file (gluon.Trainer.save_states)"
            fix = "load it with mixprec.mxnet's Trainer.load_states"
        elif b"torch" in head:
            what = "a PyTorch checkpoint in torch's legacy pickle format"
            fix = "load it with torch.load (or mixprec.torch)"
        else:
            what = "a Python pickle"
            fix = "write JAX checkpoints with Optimizer.save"
        raise _not_a_checkpoint(label, what, f"{fix}; {never}")
    if head.startswith(b"\x93NUMPY"):
        raise _not_a_checkpoint(
            label,
            "a single NumPy array (.npy, numpy.save)",
            "write checkpoints with Optimizer.save, which keeps every array of the state",
        )
    raise CheckpointError(
        f"{label} is not a mixprec-jax checkpoint: it does not start like a .npz (zip) file "
        f"({size} bytes; it begins {head[:8]!r}). Was it truncated at the start or written by "
        "another program? Load a file Optimizer.save wrote"
    )


def _central_directory(fp: IO[bytes], label: str) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(fp)
    except _PARSE_ERRORS as exc:
        raise CheckpointError(
            f"{label} is truncated or not a readable zip archive ({type(exc).__name__}: "
            f"{exc}): was the save interrupted, or the file cut short in a copy? Load the "
            "checkpoint the last complete Optimizer.save wrote (nothing was loaded)"
        ) from None


def _members(zf: zipfile.ZipFile, label: str) -> dict[str, zipfile.ZipInfo]:
    """Each ``.npy`` member by array name, from the central directory (nothing inflated)."""
    infos = zf.infolist()
    names = [info.filename for info in infos]
    if any(name.endswith("data.pkl") or name.endswith("/version") for name in names):
        raise _not_a_checkpoint(
            label,
            "a PyTorch checkpoint (torch.save)",
            "load it with torch.load (or mixprec.torch); write JAX checkpoints with Optimizer.save",
        )
    members: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        name = info.filename
        if not name.endswith(".npy") or name[:-4] in members:
            why = "a second member of that name" if name.endswith(".npy") else "not an array"
            raise CheckpointError(
                f"{label} holds a zip member {name!r} ({why}) that no mixprec-jax checkpoint "
                f"has; {_DAMAGED}"
            )
        if info.flag_bits & 0x1 or info.compress_type not in (
            zipfile.ZIP_STORED,
            zipfile.ZIP_DEFLATED,
        ):
            raise CheckpointError(
                f"{label}: the member {name!r} is encrypted or compressed with method "
                f"{info.compress_type}; NumPy writes stored or deflated members. {_DAMAGED}"
            )
        members[name[:-4]] = info
    if _META not in members:
        raise _not_a_checkpoint(
            label,
            "a .npz file without mixprec-jax's header (a plain numpy.savez?)",
            "load the leaves of a plain numpy.savez as the plugin's README shows, or write "
            "checkpoints with Optimizer.save",
        )
    return members


def _check_declared(info: zipfile.ZipInfo, cap: int, label: str, what: str) -> None:
    if info.file_size > cap:
        raise CheckpointError(
            f"{label}: the zip member {info.filename!r} declares {info.file_size} bytes "
            f"inflated, more than {what} can take ({cap} bytes); refused before inflating "
            f"anything. {_DAMAGED}"
        )


def _read_exact(fp: IO[bytes], size: int) -> bytes:
    parts, left = [], size
    while left:
        part = fp.read(min(left, _CHUNK))
        if not part:
            raise EOFError(f"the member ends {left} bytes early")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _read_npy(
    zf: zipfile.ZipFile, info: zipfile.ZipInfo
) -> tuple[tuple[int, ...], np.dtype[Any], Any]:
    """A member's header, then (a callable reading) its data: the caller checks the header
    before any data is read."""
    fp = zf.open(info)
    version = _NPY.read_magic(fp)
    if version == (1, 0):
        header = _NPY.read_array_header_1_0(fp, max_header_size=NPY_HEADER_CAP)
    elif version == (2, 0):
        header = _NPY.read_array_header_2_0(fp, max_header_size=NPY_HEADER_CAP)
    else:
        raise ValueError(f".npy version {version}")
    shape, fortran, dtype = header

    def data() -> npt.NDArray[Any]:
        if dtype.hasobject:
            raise ValueError("an array of Python objects")
        raw = _read_exact(fp, math.prod(shape) * dtype.itemsize)
        if fp.read(1):  # reads to the member's end: zipfile checks its CRC-32 there
            raise ValueError("bytes after the array's data")
        fp.close()
        return np.frombuffer(raw, dtype).reshape(shape, order="F" if fortran else "C")

    return tuple(shape), dtype, data


def _header(zf: zipfile.ZipFile, info: zipfile.ZipInfo, label: str) -> dict[str, Any]:
    """The JSON header: the format's UTF-8 bytes, or a unicode scalar (``mixprec-jax/1``)."""
    try:
        shape, dtype, data = _read_npy(zf, info)
        if dtype == np.uint8 and len(shape) == 1:
            text = data().tobytes().decode("utf-8")
        elif dtype.kind == "U" and shape == ():
            text = str(data()[()])
        else:
            raise ValueError(f"a header of dtype {dtype} and shape {list(shape)}")
        meta = json.loads(text)
    except CheckpointError:
        raise
    except (*_PARSE_ERRORS, UnicodeError) as exc:
        raise CheckpointError(
            f"{label}: the checkpoint's header is unreadable ({type(exc).__name__}: {exc}); "
            f"{_DAMAGED}"
        ) from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{label}: the checkpoint's header is not a JSON object; {_DAMAGED}")
    return meta


def _check_header(meta: dict[str, Any], label: str) -> tuple[Policy, dict[str, str], str | None]:
    """The saved policy, the dtypes and the arrays' checksum (None in a legacy file)."""
    fmt = meta.get("format")
    if fmt not in (FORMAT, *LEGACY_FORMATS):
        raise CheckpointError(
            f"{label}: unknown checkpoint format {fmt!r}; this mixprec-jax reads {FORMAT} and "
            f"{', '.join(LEGACY_FORMATS)}. Load it with the mixprec-jax release that wrote it"
        )
    arrays_sha: str | None = None
    if fmt == FORMAT:
        sha = meta.get("sha256")
        if not isinstance(sha, dict) or not all(
            isinstance(sha.get(k), str) for k in ("header", "arrays")
        ):
            raise CheckpointError(f"{label}: the header has no checksums; {_DAMAGED}")
        if hashlib.sha256(_canonical(meta)).hexdigest() != sha["header"]:
            raise CheckpointError(
                f"{label}: the header does not match its SHA-256 checksum; {_DAMAGED}"
            )
        arrays_sha = sha["arrays"]
        if meta.get("kind") == "params":
            raise _not_a_checkpoint(
                label,
                "a parameters file (Optimizer.save_params, for inference)",
                "resume from a file Optimizer.save wrote; read this one with numpy.load",
            )
    dtypes = meta.get("dtypes")
    if not isinstance(dtypes, dict) or not all(isinstance(v, str) for v in dtypes.values()):
        raise CheckpointError(f"{label}: the header's dtypes are unreadable; {_DAMAGED}")
    try:
        saved = Policy.from_dict(meta["policy"])
    except _POLICY_ERRORS as exc:
        raise CheckpointError(
            f"{label}: the header's policy is unreadable ({type(exc).__name__}: {exc}); {_DAMAGED}"
        ) from None
    return saved, dtypes, arrays_sha


def _read_arrays(
    zf: zipfile.ZipFile,
    members: Mapping[str, zipfile.ZipInfo],
    expected: Mapping[str, _Expected],
    dtypes: Mapping[str, str],
    label: str,
) -> dict[str, npt.NDArray[Any]]:
    arrays = {}
    for name, want in expected.items():
        saved_dtype = dtypes.get(name)
        if saved_dtype is None:
            raise CheckpointError(f"{label}: the header has no dtype for {name}; {_DAMAGED}")
        try:
            shape, raw, data = _read_npy(zf, members[name])
            if saved_dtype != want.dtype or shape != want.shape:
                raise CheckpointError(
                    f"{name}: the checkpoint has {saved_dtype}{list(shape)}, the state "
                    f"{want.dtype}{list(want.shape)}; load it into a state made by the same "
                    "model, optimizer and policy"
                )
            if raw != want.raw:
                raise CheckpointError(
                    f"{label}: {name} is stored as {raw}, its header says {saved_dtype}; {_DAMAGED}"
                )
            # the data is inflated only below the cap its shape gives it
            _check_declared(members[name], want.cap, label, f"{name} ({want.dtype}{list(shape)})")
            arrays[name] = data()
        except CheckpointError:
            raise
        except _PARSE_ERRORS as exc:
            raise CheckpointError(
                f"{label}: the array {name} is unreadable ({type(exc).__name__}: {exc}); {_DAMAGED}"
            ) from None
    return arrays


def _has_non_finite(value: Any) -> bool:
    return bool(jnp.issubdtype(value.dtype, jnp.inexact) and not np.isfinite(value).all())


def _check_finite(values: Mapping[str, Any], leaves: Mapping[str, Any], label: str) -> None:
    for name, value in values.items():
        if not _has_non_finite(value):
            continue
        leaf = leaves[name]
        if isinstance(leaf, jax.Array | np.ndarray | np.generic) and _has_non_finite(
            np.asarray(jax.device_get(leaf))
        ):
            continue  # the state itself starts non-finite there (see the module docstring)
        count = int(value.size - np.isfinite(value).sum())
        raise CheckpointError(
            f"{label}: {name} holds {count} inf/NaN value(s); loaded, they would reach the "
            "weights at the next step, which the step's guard cannot see (it checks "
            "gradients). The run had diverged before this save, or the file is damaged: "
            "load an earlier checkpoint (nothing was loaded)"
        )


def load(file: str | IO[bytes], like: State, policy: Policy) -> State:
    """The state :func:`save` wrote, with ``like``'s structure; checked before it is built.

    Reads ``mixprec-jax/2`` files and, without the checksums, the ``mixprec-jax/1`` files of
    earlier releases. Nothing is built before every check has passed (the module docstring
    lists them), and nothing is ever unpickled.

    :raises CheckpointError: a file that is not a mixprec-jax checkpoint (named when it is a
        Gluon, PyTorch, pickle or ``.npy`` file), an empty, truncated, oversized or damaged
        file (a zip bomb, a flipped byte, a failed checksum), another policy, a missing or
        extra array, one whose shape or dtype differs from ``like``'s, or inf/NaN values.
    """
    names = leaf_names(like)
    leaves, treedef = jax.tree_util.tree_flatten(like)
    expected = {name: _expected(name, leaf) for name, leaf in zip(names, leaves, strict=True)}
    meta_cap = _meta_cap(expected)
    total_cap = meta_cap + sum(want.cap for want in expected.values())
    file_cap = (
        total_cap
        + _ZIP_END_OVERHEAD
        + sum(_ZIP_MEMBER_OVERHEAD + 2 * (len(name) + 4) for name in [_META, *expected])
    )
    label = _label(file)
    with _opened(file, label, file_cap) as (fp, size):
        if size > file_cap:
            raise CheckpointError(
                f"{label} is {size} bytes, more than a checkpoint of this state can be "
                f"({file_cap} bytes for its {len(expected)} arrays): a larger model's "
                "checkpoint, or a damaged file; refused before reading it. Load it into a "
                "state made by the same model and optimizer"
            )
        start = fp.tell()
        head = fp.read(_SNIFF)
        fp.seek(start)
        _identify(head, label, size)
        with _central_directory(fp, label) as zf:
            members = _members(zf, label)
            declared = sum(info.file_size for info in members.values())
            if declared > total_cap:
                raise CheckpointError(
                    f"{label}: its members declare {declared} bytes inflated, more than a "
                    f"checkpoint of this state can hold ({total_cap} bytes); refused before "
                    f"inflating anything. {_DAMAGED}"
                )
            _check_declared(members[_META], meta_cap, label, "a checkpoint's header")
            meta = _header(zf, members[_META], label)
            saved, dtypes, arrays_sha = _check_header(meta, label)
            if saved != policy:  # Policy equality ignores the display name
                raise CheckpointError(
                    f"the checkpoint was saved under a different policy ({saved}); build the "
                    f"Optimizer with policy={str(saved)!r} to resume it"
                )
            present = set(members) - {_META}
            if set(names) != present:
                missing, extra = sorted(set(names) - present), sorted(present - set(names))
                raise CheckpointError(
                    f"the checkpoint does not match this state: missing {missing[:5]}, "
                    f"unexpected {extra[:5]}; load it into a state made by the same model and "
                    "optimizer"
                )
            arrays = _read_arrays(zf, members, expected, dtypes, label)
    if arrays_sha is not None and _arrays_digest(arrays) != arrays_sha:
        raise CheckpointError(
            f"{label}: the arrays do not match the header's SHA-256 checksum (a changed "
            f"byte); {_DAMAGED}"
        )
    values = {name: arrays[name].view(jnp.dtype(want.dtype)) for name, want in expected.items()}
    _check_finite(values, dict(zip(names, leaves, strict=True)), label)
    return treedef.unflatten([jnp.asarray(values[name]) for name in names])  # type: ignore[no-any-return]
