"""Each refusal of ``load``, reached on its own: a hostile file crafted to pass every earlier
check, the message that names its problem, and how far the file was read (issue 37).

``test_checkpoint_files.py`` shows that hostile files are refused; a file refused by an early
check says nothing of the checks behind it. Here each file is right in every respect but
one, so that only the check under test can refuse it; the size caps are pinned at their
boundary (a file or member exactly at its cap loads, one byte more is refused), and a
refusal made before inflating or reading is checked by recording what the loader read: the
bytes asked of each zip member it opened, and of the stream it was given.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import re
import signal
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mixprec.jax as mpj
from mixprec.errors import CheckpointError
from mixprec_jax import checkpoint

PARAMS = {"dense": {"kernel": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "bias": jnp.ones(3)}}
BIAS, KERNEL = "weights.dense.bias", "weights.dense.kernel"


def _bits(tree: Any) -> list[bytes]:
    return [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(tree)]


@pytest.fixture(scope="module")
def saved() -> tuple[mpj.Optimizer, mpj.State, bytes]:
    """A state with bfloat16 weights and compensation (O3-bf16-kahan), and its file."""
    opt = mpj.Optimizer(optax.sgd(0.1), policy="O3-bf16-kahan")
    state = opt.init(PARAMS)
    buffer = io.BytesIO()
    opt.save(buffer, state)
    return opt, state, buffer.getvalue()


def _load(opt: mpj.Optimizer, like: mpj.State, blob: bytes) -> mpj.State:
    return opt.load(io.BytesIO(blob), like=like)


class _Counting:
    """A zip member as the loader reads it, counting the bytes it is asked for."""

    def __init__(self, member: Any, reads: dict[str, int], name: str) -> None:
        self._member, self._reads, self._name = member, reads, name

    def read(self, n: int = -1) -> bytes:
        data: bytes = self._member.read(n)
        self._reads[self._name] += len(data)
        return data

    def close(self) -> None:
        self._member.close()


def _refused(load: Callable[[], object]) -> tuple[str, dict[str, int]]:
    """The message of the CheckpointError ``load()`` raises, and the bytes read meanwhile
    from each zip member the loader opened, by member name (a member never opened is
    absent: nothing of it was inflated)."""
    reads: dict[str, int] = {}
    real = zipfile.ZipFile.open

    def opened(self: zipfile.ZipFile, name: Any, *args: Any, **kwargs: Any) -> _Counting:
        key = name.filename if isinstance(name, zipfile.ZipInfo) else name
        reads.setdefault(key, 0)
        return _Counting(real(self, name, *args, **kwargs), reads, key)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(zipfile.ZipFile, "open", opened)
        with pytest.raises(CheckpointError) as info:
            load()
    return str(info.value), reads


# ---------------------------------------------------------------------- building files


def _entries(blob: bytes) -> dict[str, bytes]:
    """Each member's bytes, in the file's order."""
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        return {info.filename: zf.read(info) for info in zf.infolist()}


def _npz(entries: dict[str, bytes], method: int = zipfile.ZIP_STORED) -> bytes:
    """A valid zip archive of these members (CRCs and sizes right)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=method) as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    return out.getvalue()


class _Member(NamedTuple):
    name: str
    data: bytes
    method: int = zipfile.ZIP_STORED
    flags: int = 0


def _zip(members: Iterable[_Member], gap: int = 0) -> bytes:
    """A zip archive written by hand (what ``zipfile`` refuses to write: two members of one
    name, an encryption flag), with ``gap`` zero bytes between the last member and the
    central directory (a reader finds the members from the directory: the gap is inert)."""
    out, central, count = bytearray(), bytearray(), 0
    for name, data, method, flags in members:
        encoded, offset, crc = name.encode(), len(out), zlib.crc32(data)
        sizes = (crc, len(data), len(data), len(encoded))
        local = struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, flags, method, 0, 0, *sizes, 0)
        out += local + encoded + data
        entry = (20, 20, flags, method, 0, 0, *sizes, 0, 0, 0, 0, 0, offset)
        central += struct.pack("<4s6H3L5H2L", b"PK\x01\x02", *entry)
        central += encoded
        count += 1
    out += bytes(gap)
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, count, count, len(central), len(out), 0)
    return bytes(out + central + end)


def _npy(
    value: np.ndarray[Any, Any],
    size: int | None = None,
    version: int = 1,
    fortran: bool = False,
    descr: str | None = None,
) -> bytes:
    """A ``.npy`` member of ``value`` whose header is padded with spaces to make the member
    ``size`` bytes long (NumPy reads headers of up to 4096 bytes), in that format version."""
    descr = descr or np.lib.format.dtype_to_descr(value.dtype)
    text = f"{{'descr': {descr!r}, 'fortran_order': {fortran}, 'shape': {value.shape}, }}"
    data = value.tobytes(order="F" if fortran else "C")
    prefix = 6 + 2 + (2 if version == 1 else 4)
    length = 64 * math.ceil((prefix + len(text) + 1) / 64) - prefix
    if size is not None:
        length = size - prefix - len(data)
    header = text.ljust(length - 1).encode() + b"\n"
    count = struct.pack("<H" if version == 1 else "<I", len(header))
    return b"\x93NUMPY" + bytes([version, 0]) + count + header + data


def _stored(blob: bytes) -> dict[str, np.ndarray[Any, Any]]:
    """Each array of the file as it is stored (bfloat16 as its uint16 bits)."""
    return {
        name[:-4]: np.load(io.BytesIO(data))
        for name, data in _entries(blob).items()
        if name != "__meta__.npy"
    }


def _forged(
    opt: mpj.Optimizer,
    arrays: dict[str, np.ndarray[Any, Any]],
    dtypes: dict[str, str],
    policy: dict[str, Any] | None = None,
) -> bytes:
    """A file written the way ``save`` writes one, with both checksums right, of whatever
    arrays and header it is given: only the loader's own checks can refuse it."""
    meta = {"kind": "state", "policy": policy or opt.policy.to_dict(), "dtypes": dtypes}
    out = io.BytesIO()
    checkpoint._write(out, arrays, meta)
    return out.getvalue()


def _dtypes(blob: bytes) -> dict[str, str]:
    header: dict[str, str] = json.loads(_entries(blob)["__meta__.npy"][128:])["dtypes"]
    return header


class _Caps(NamedTuple):
    header: int
    arrays: dict[str, int]
    total: int
    file: int


def _caps(state: mpj.State, blob: bytes) -> _Caps:
    """The caps the module docstring describes, worked out here: an array's own bytes plus a
    ``.npy`` header; the JSON header's 64 KiB and 64 bytes more per array (4 bytes a
    character, a first-format header being a NumPy string); the file, their sum plus the
    zip's records."""
    names = list(_dtypes(blob))
    leaves = dict(zip(names, _stored(blob).values(), strict=True))
    assert [leaf.shape for leaf in leaves.values()] == [
        leaf.shape for leaf in jax.tree_util.tree_leaves(state)
    ]
    arrays = {name: leaf.nbytes + checkpoint.NPY_HEADER_CAP for name, leaf in leaves.items()}
    header = 4 * (checkpoint.META_BASE_CAP + sum(len(n) + 64 for n in names))
    header += checkpoint.NPY_HEADER_CAP
    total = header + sum(arrays.values())
    records = sum(
        checkpoint._ZIP_MEMBER_OVERHEAD + 2 * (len(name) + 4) for name in ["__meta__", *names]
    )
    return _Caps(header, arrays, total, total + checkpoint._ZIP_END_OVERHEAD + records)


def _at_caps(blob: bytes, caps: _Caps, over: str | None = None) -> dict[str, bytes]:
    """The members of ``blob`` padded to exactly their caps (the arrays' ``.npy`` headers
    with spaces, the JSON with spaces after it), ``over`` one byte past its cap."""
    entries = _entries(blob)
    arrays = _stored(blob)
    padded = {}
    for name in entries:
        key = name[:-4]
        if key == "__meta__":
            size = caps.header + (key == over)
            text = entries[name][128:].ljust(size - 128)  # JSON allows spaces after it
            padded[name] = _npy(np.frombuffer(text, np.uint8), size=size)
        else:
            padded[name] = _npy(arrays[key], size=caps.arrays[key] + (key == over))
    return padded


# ---------------------------------------------------------------------- the file's size


class _Pipe:
    """A reader with nothing but ``read`` (no ``seekable``): a pipe, whose reads may come
    back short; counts the bytes it gave."""

    def __init__(self, data: bytes, short: bool = False) -> None:
        self._data, self._short, self.given = data, short, 0

    def read(self, n: int = -1) -> bytes:
        if self._short and n > 1:
            n -= 1  # one byte short of every ask
        part = self._data[self.given : self.given + n]
        self.given += len(part)
        return part


class _Seekable(io.BytesIO):
    """A seekable stream that counts the bytes read from it."""

    given = 0

    def read(self, n: int | None = -1) -> bytes:
        part = super().read(n)
        self.given += len(part)
        return part


def test_a_file_at_the_size_cap_loads_and_one_byte_more_is_refused_unread(saved: Any) -> None:
    """The file's cap is what its arrays, header and zip records can take: at the cap (inert
    bytes before the central directory) it loads; one byte over, it is refused before a
    byte of it is read."""
    opt, state, blob = saved
    caps = _caps(state, blob)
    members = [_Member(name, data) for name, data in _entries(blob).items()]
    at_cap = _zip(members, gap=caps.file - len(_zip(members)))
    assert len(at_cap) == caps.file
    assert _bits(_load(opt, state, at_cap)) == _bits(state)
    stream = _Seekable(at_cap + b"\0")
    message, reads = _refused(lambda: opt.load(stream, like=state))
    expected = f"is {caps.file + 1} bytes, more than a checkpoint of this state can be "
    assert expected + f"({caps.file} bytes for its 9 arrays)" in message
    assert "refused before reading it" in message
    assert stream.given == 0 and reads == {}


def test_the_size_of_a_stream_counts_from_where_it_stands(saved: Any) -> None:
    """A stream is read from its position: bytes before it are not the file's, and a stream
    standing at its end is an empty file."""
    opt, state, blob = saved
    caps = _caps(state, blob)
    members = [_Member(name, data) for name, data in _entries(blob).items()]
    at_cap = _zip(members, gap=caps.file - len(_zip(members)))
    stream = io.BytesIO(b"an earlier record " * 100 + at_cap)
    stream.seek(1800)
    assert _bits(opt.load(stream, like=state)) == _bits(state)
    stream.seek(0, io.SEEK_END)
    with pytest.raises(CheckpointError, match=r"is empty \(0 bytes\)"):
        opt.load(stream, like=state)


def test_a_pipe_is_read_to_one_byte_past_the_cap_and_no_further(saved: Any) -> None:
    """A reader without ``seekable`` is read until it ends or gives one byte more than the
    cap, however short its reads: a file at the cap loads, a longer one is refused having
    given exactly ``cap + 1`` bytes."""
    opt, state, blob = saved
    caps = _caps(state, blob)
    members = [_Member(name, data) for name, data in _entries(blob).items()]
    at_cap = _zip(members, gap=caps.file - len(_zip(members)))
    for short in (False, True):
        pipe = _Pipe(at_cap, short)
        assert _bits(opt.load(pipe, like=state)) == _bits(state)  # type: ignore[arg-type]
        assert pipe.given == caps.file
        pipe = _Pipe(bytes(caps.file + 1000), short)
        with pytest.raises(CheckpointError, match=f"is {caps.file + 1} bytes, more than a"):
            opt.load(pipe, like=state)  # type: ignore[arg-type]
        assert pipe.given == caps.file + 1, (short, pipe.given - caps.file)
    with pytest.raises(CheckpointError, match=r"is empty \(0 bytes\)"):
        opt.load(_Pipe(b""), like=state)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- what the file is


@pytest.mark.parametrize("protocol", [2, 5])
def test_pickles_are_named_by_what_they_hold(protocol: int, saved: Any) -> None:
    opt, state, _ = saved
    cases = {
        b"": "is a Python pickle, not a mixprec-jax checkpoint; write JAX checkpoints",
        b"torch": "is a PyTorch checkpoint in torch's legacy pickle format",
        b"mxnet": r"is a pickled Gluon states file",
    }
    for marker, message in cases.items():
        data = pickle.dumps({"weights": [1.0, 2.0], "from": marker}, protocol=protocol)
        with pytest.raises(CheckpointError, match=message) as info:
            _load(opt, state, data)
        assert "never unpickles" in str(info.value)


def test_a_pickle_needs_its_opcode_and_its_version(saved: Any) -> None:
    """The version byte alone (``\\x02`` second) after another first byte is no pickle."""
    opt, state, _ = saved
    with pytest.raises(CheckpointError, match=r"does not start like a \.npz \(zip\) file"):
        _load(opt, state, b"A\x02 plain text with a pickle's version byte")


# ---------------------------------------------------------------------- the zip's members


def test_a_member_that_is_not_an_array_is_refused_unread(saved: Any) -> None:
    opt, state, blob = saved
    data = _npz({**_entries(blob), "notes.txt": b"the run of 29 November"})
    message, reads = _refused(lambda: _load(opt, state, data))
    assert "a zip member 'notes.txt' (not an array) that no mixprec-jax" in message
    assert reads == {}


def test_a_member_twice_is_refused_unread(saved: Any) -> None:
    """Two members of one name (the second would shadow the first): whichever of them a
    reader took, the file is ambiguous."""
    opt, state, blob = saved
    entries = _entries(blob)
    members = [_Member(name, data) for name, data in entries.items()]
    twice = _zip([*members, _Member(f"{BIAS}.npy", entries[f"{BIAS}.npy"])])
    message, reads = _refused(lambda: _load(opt, state, twice))
    assert f"a zip member '{BIAS}.npy' (a second member of that name)" in message
    assert reads == {}


@pytest.mark.parametrize(
    ("method", "flags", "message"),
    [
        (zipfile.ZIP_STORED, 0x1, "encrypted or compressed with method 0;"),
        (zipfile.ZIP_BZIP2, 0, "encrypted or compressed with method 12;"),
        (zipfile.ZIP_LZMA, 0, "encrypted or compressed with method 14;"),
    ],
)
def test_an_encrypted_or_foreign_compressed_member_is_refused_unread(
    method: int, flags: int, message: str, saved: Any
) -> None:
    """NumPy writes stored or deflated members: an encrypted one (flag bit 0) or another
    method is refused from the central directory, never handed to a decompressor."""
    opt, state, blob = saved
    entries, target = _entries(blob), f"{BIAS}.npy"
    if flags:
        data = _zip(_Member(n, d, flags=flags * (n == target)) for n, d in entries.items())
    else:
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as zf:
            for name, member in entries.items():
                zf.writestr(name, member, compress_type=method if name == target else None)
        data = out.getvalue()
    refusal, reads = _refused(lambda: _load(opt, state, data))
    assert f"the member '{BIAS}.npy' is {message}" in refusal
    assert reads == {}


@pytest.mark.parametrize("marker", ["archive/data.pkl", "archive/version"])
def test_either_mark_of_a_torch_zip_names_it(marker: str, saved: Any) -> None:
    opt, state, blob = saved
    with pytest.raises(CheckpointError, match=r"is a PyTorch checkpoint \(torch\.save\)"):
        _load(opt, state, _npz({marker: b"3", **_entries(blob)}))


# ---------------------------------------------------------------------- declared sizes


def test_members_at_their_caps_load(saved: Any) -> None:
    """Every member at exactly its cap (so their sum is exactly the members' total cap):
    the checks compare with ``>``, and such a file is a checkpoint."""
    opt, state, blob = saved
    caps = _caps(state, blob)
    padded = _at_caps(blob, caps)
    assert sum(map(len, padded.values())) == caps.total
    assert _bits(_load(opt, state, _npz(padded))) == _bits(state)


def test_one_byte_past_the_members_total_cap_is_refused_uninflated(saved: Any) -> None:
    opt, state, blob = saved
    caps = _caps(state, blob)
    data = _npz(_at_caps(blob, caps, over=BIAS))
    message, reads = _refused(lambda: _load(opt, state, data))
    assert f"its members declare {caps.total + 1} bytes inflated" in message
    assert f"can hold ({caps.total} bytes); refused before inflating" in message
    assert reads == {}


def test_a_header_one_byte_past_its_cap_is_refused_uninflated(saved: Any) -> None:
    """The header's own cap, under the total (the arrays' members are far below theirs)."""
    opt, state, blob = saved
    caps = _caps(state, blob)
    header = _at_caps(blob, caps, "__meta__")["__meta__.npy"]
    data = _npz({**_entries(blob), "__meta__.npy": header})
    message, reads = _refused(lambda: _load(opt, state, data))
    expected = f"'__meta__.npy' declares {caps.header + 1} bytes inflated, more than a "
    assert expected + f"checkpoint's header can take ({caps.header} bytes)" in message
    assert reads == {}


def test_an_array_one_byte_past_its_cap_is_refused_before_its_data(saved: Any) -> None:
    """An array's member is checked against its cap once its ``.npy`` header has matched
    the state: the header is read, its data never."""
    opt, state, blob = saved
    caps = _caps(state, blob)
    data = _npz({**_entries(blob), f"{BIAS}.npy": _at_caps(blob, caps, BIAS)[f"{BIAS}.npy"]})
    message, reads = _refused(lambda: _load(opt, state, data))
    expected = f"'{BIAS}.npy' declares {caps.arrays[BIAS] + 1} bytes inflated, more than "
    assert expected + f"{BIAS} (bfloat16[3]) can take ({caps.arrays[BIAS]} bytes)" in message
    assert reads[f"{BIAS}.npy"] == caps.arrays[BIAS] + 1 - 3 * 2  # all but its 3 values


@contextmanager
def _within(seconds: float) -> Iterator[None]:
    """Stop the block after ``seconds`` (a loader looping forever fails the test)."""

    class Endless(Exception):
        pass

    def stop(*_: object) -> None:
        raise Endless(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_an_array_whose_member_ends_early_is_refused(saved: Any) -> None:
    """A ``.npy`` header that matches the state over a member two bytes short of its data
    (a valid zip: the CRC is of the bytes there are)."""
    opt, state, blob = saved
    entries = _entries(blob)
    entries[f"{BIAS}.npy"] = entries[f"{BIAS}.npy"][:-2]
    with _within(2.0), pytest.raises(CheckpointError) as info:
        _load(opt, state, _npz(entries))
    message = f"the array {BIAS} is unreadable (EOFError: the member ends 2 bytes early)"
    assert message in str(info.value)


def test_bytes_after_an_arrays_data_are_refused(saved: Any) -> None:
    """The data's length is the header's shape: more bytes in the member are not ignored
    (the checksum covers the data only, so it would not see them)."""
    opt, state, blob = saved
    entries = _entries(blob)
    entries[f"{BIAS}.npy"] += b"\0\0"
    with pytest.raises(CheckpointError) as info:
        _load(opt, state, _npz(entries))
    message = f"the array {BIAS} is unreadable (ValueError: bytes after the array's data)"
    assert message in str(info.value)


# ---------------------------------------------------------------------- .npy members


def test_members_of_npy_format_2_and_fortran_order_load(saved: Any) -> None:
    """What ``numpy.save`` may write besides format 1.0 and C order: format 2.0 (for headers
    over 64 KiB) and Fortran order; the numbers are the same."""
    opt, state, blob = saved
    stored = _stored(blob)
    entries = {f"{name}.npy": _npy(value, version=2) for name, value in stored.items()}
    text = np.frombuffer(_entries(blob)["__meta__.npy"][128:], np.uint8)
    entries["__meta__.npy"] = _npy(text, version=2)
    assert _bits(_load(opt, state, _npz(entries))) == _bits(state)
    fortran = {**_entries(blob), f"{KERNEL}.npy": _npy(stored[KERNEL], fortran=True)}
    assert stored[KERNEL].shape == (2, 3)
    assert _bits(_load(opt, state, _npz(fortran))) == _bits(state)


def test_a_member_of_npy_format_3_is_refused(saved: Any) -> None:
    opt, state, blob = saved
    entries = {**_entries(blob), f"{BIAS}.npy": _npy(_stored(blob)[BIAS], version=3)}
    with pytest.raises(CheckpointError) as info:
        _load(opt, state, _npz(entries))
    message = f"the array {BIAS} is unreadable (ValueError: .npy version (3, 0))"
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("header", "what"),
    [
        (lambda text: np.frombuffer(text, np.uint8)[None], "uint8 and shape [1, {n}]"),
        (lambda text: np.array(text[0], np.uint8), "uint8 and shape []"),
        (lambda text: np.array([text.decode()]), "<U{n} and shape [1]"),
        (lambda text: np.frombuffer(text[:8], np.float32), "float32 and shape [2]"),
    ],
)
def test_a_header_of_another_dtype_or_shape_is_refused(
    header: Callable[[bytes], np.ndarray[Any, Any]], what: str, saved: Any
) -> None:
    """The JSON header is UTF-8 bytes (a 1-d uint8 array) or, in the first format, a NumPy
    string scalar: the same text in any other array is refused, and no array is opened."""
    opt, state, blob = saved
    text = _entries(blob)["__meta__.npy"][128:]
    data = _npz({**_entries(blob), "__meta__.npy": _npy(header(text))})
    message, reads = _refused(lambda: _load(opt, state, data))
    expected = "the checkpoint's header is unreadable (ValueError: a header of dtype "
    assert expected + what.format(n=len(text)) + ")" in message
    assert set(reads) == {"__meta__.npy"}


# ---------------------------------------------------------------------- the header's content


def test_a_policy_past_a_floats_range_is_refused(saved: Any) -> None:
    """A loss scale of 10**400 in a signed header (a JSON integer no float holds): the
    policy is unreadable (this was a bare OverflowError)."""
    opt, state, blob = saved
    policy = {**opt.policy.to_dict(), "loss_scale": 10**400}
    data = _forged(opt, _stored(blob), _dtypes(blob), policy)
    with pytest.raises(CheckpointError, match=r"the header's policy is unreadable \(Policy") as e:
        _load(opt, state, data)
    assert "StaticScale.scale must be a positive finite number, got an integer of 401" in str(
        e.value
    )


def test_another_policy_is_refused_before_any_array_is_read(saved: Any) -> None:
    _, state, blob = saved
    other = mpj.Optimizer(optax.sgd(0.1), policy="O3-bf16-sr")
    message, reads = _refused(lambda: other.load(io.BytesIO(blob), like=state))
    assert "was saved under a different policy (O3-bf16-kahan); build the" in message
    assert set(reads) == {"__meta__.npy"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("extra", r"missing \[\], unexpected \['weights\.dense\.extra'\]"),
        ("missing", r"missing \['compensation\.dense\.bias'\], unexpected \[\]"),
    ],
)
def test_an_extra_or_missing_array_is_refused_before_any_is_read(
    change: str, message: str, saved: Any
) -> None:
    opt, state, blob = saved
    arrays, dtypes = _stored(blob), _dtypes(blob)
    if change == "extra":
        arrays["weights.dense.extra"], dtypes["weights.dense.extra"] = np.zeros(2), "float64"
    else:
        del arrays["compensation.dense.bias"], dtypes["compensation.dense.bias"]
    data = _forged(opt, arrays, dtypes)
    refusal, reads = _refused(lambda: _load(opt, state, data))
    assert re.search(message, refusal), refusal
    assert set(reads) == {"__meta__.npy"}


def test_an_array_without_a_dtype_in_the_header_is_refused(saved: Any) -> None:
    opt, state, blob = saved
    dtypes = _dtypes(blob)
    del dtypes[BIAS]
    with pytest.raises(CheckpointError, match=rf"the header has no dtype for {BIAS};"):
        _load(opt, state, _forged(opt, _stored(blob), dtypes))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("shape", rf"{KERNEL}: the checkpoint has bfloat16\[3, 2\], the state bfloat16\[2, "),
        ("dtype", rf"{BIAS}: the checkpoint has uint16\[3\], the state bfloat16\[3\]"),
        ("stored", rf"{BIAS} is stored as float16, its header says bfloat16"),
    ],
)
def test_an_array_of_another_shape_or_dtype_is_refused_before_its_data(
    change: str, message: str, saved: Any
) -> None:
    """Each differs in one respect, signed as ``save`` signs: another shape (same dtype),
    another dtype in the header (same bits: bfloat16 is stored as uint16), or data stored
    as another dtype than the header's. The member's header is read, its data never."""
    opt, state, blob = saved
    arrays, dtypes = _stored(blob), _dtypes(blob)
    if change == "shape":
        arrays[KERNEL] = arrays[KERNEL].reshape(3, 2)
    elif change == "dtype":
        dtypes[BIAS] = "uint16"
    else:
        arrays[BIAS] = arrays[BIAS].view(np.float16)
    data = _forged(opt, arrays, dtypes)
    refusal, reads = _refused(lambda: _load(opt, state, data))
    assert re.search(message, refusal), refusal
    name = f"{KERNEL if change == 'shape' else BIAS}.npy"
    assert reads[name] == 128  # the .npy header NumPy writes, and no more
