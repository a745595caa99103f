"""Hostile and damaged checkpoint files: every one is a CheckpointError that says what the
file is and what to do, raised before anything is built (issue 37's findings on ``load``).

The files of other frameworks in ``tests/data`` were written by the frameworks themselves
(MXNet 1.9.1 and torch 2.13.0 in the repository's ``.venv``): ``mixprec_gluon.states`` by
``mixprec.mxnet.Trainer.save_states``, ``gluon.states`` by ``gluon.Trainer.save_states``,
``gluon.params`` by ``net.save_parameters``, ``torch.pt`` by ``torch.save``.
"""

from __future__ import annotations

import io
import json
import struct
import tracemalloc
import zipfile
import zlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mixprec.jax as mpj
from mixprec.errors import CheckpointError
from mixprec_jax import checkpoint

DATA = Path(__file__).parent / "data"
PARAMS = {"dense": {"kernel": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "bias": jnp.ones(3)}}


def _loss(p: Any, b: Any) -> jax.Array:
    return jnp.mean((b @ p["dense"]["kernel"] + p["dense"]["bias"]) ** 2)


def _trained(policy: str = "O3-bf16-kahan", tx: Any = None) -> tuple[mpj.Optimizer, mpj.State]:
    """An optimizer and its state after two steps (bfloat16 weights and compensation under
    the default policy: the raw-bits path is in every file)."""
    opt = mpj.Optimizer(tx or optax.sgd(0.1), policy=policy)
    state = opt.init(PARAMS)
    step = opt.make_step(_loss)
    for _ in range(2):
        _, state, _ = step(state, jnp.ones((4, 2)))
    return opt, state


def _saved(opt: mpj.Optimizer, state: mpj.State) -> bytes:
    buffer = io.BytesIO()
    opt.save(buffer, state)
    return buffer.getvalue()


def _bits(tree: Any) -> list[bytes]:
    return [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(tree)]


@pytest.fixture(scope="module")
def saved() -> tuple[mpj.Optimizer, mpj.State, bytes]:
    opt, state = _trained()
    return opt, state, _saved(opt, state)


def _load(opt: mpj.Optimizer, like: mpj.State, blob: bytes) -> mpj.State:
    return opt.load(io.BytesIO(blob), like=like)


def test_a_saved_state_loads_bit_for_bit(saved: tuple[mpj.Optimizer, mpj.State, bytes]) -> None:
    opt, state, blob = saved
    assert _bits(_load(opt, state, blob)) == _bits(state)
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        meta = json.loads(zf.read("__meta__.npy")[128:].decode())
    assert meta["format"] == "mixprec-jax/2" and set(meta["sha256"]) == {"header", "arrays"}


# ---------------------------------------------------------------------- truncated, not a zip


def test_every_truncation_is_refused(saved: tuple[mpj.Optimizer, mpj.State, bytes]) -> None:
    """Cut at every length (EOFError and BadZipFile went through before)."""
    opt, state, blob = saved
    for length in range(len(blob)):
        with pytest.raises(CheckpointError, match=r"empty|truncated|damaged|not a") as info:
            _load(opt, state, blob[:length])
        assert "load" in str(info.value).lower(), str(info.value)


def test_a_bad_zip_and_garbage_are_refused(saved: tuple[mpj.Optimizer, mpj.State, bytes]) -> None:
    opt, state, blob = saved
    cases = {
        b"PK\x03\x04" + bytes(range(256)) * 4: "truncated or not a readable zip",
        b"not a file": "does not start like a .npz",
        blob[:-22] + b"PK\x05\x06" + b"\xff" * 18: "truncated or not a readable zip",
    }
    for data, message in cases.items():
        with pytest.raises(CheckpointError, match=message):
            _load(opt, state, data)


def test_files_that_are_not_files(tmp_path: Path, saved: Any) -> None:
    opt, state, _ = saved
    with pytest.raises(CheckpointError, match=r"cannot open the checkpoint .*missing"):
        opt.load(tmp_path / "missing.npz", like=state)
    with pytest.raises(CheckpointError, match="cannot open the checkpoint"):
        opt.load(tmp_path, like=state)
    (tmp_path / "empty.npz").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"is empty \(0 bytes\)"):
        opt.load(tmp_path / "empty.npz", like=state)


class _Stream(io.RawIOBase):
    """A pipe-like reader: not seekable, and at most 1000 bytes a read."""

    def __init__(self, data: bytes) -> None:
        self._data = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        return self._data.read(1000 if n < 0 else min(n, 1000))


def test_a_stream_is_read_up_to_the_cap(saved: tuple[mpj.Optimizer, mpj.State, bytes]) -> None:
    opt, state, blob = saved
    assert _bits(opt.load(_Stream(blob), like=state)) == _bits(state)  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match="more than a checkpoint of this state can be"):
        opt.load(_Stream(blob + bytes(1 << 20)), like=state)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- other frameworks' files


@pytest.mark.parametrize(
    ("name", "what"),
    [
        ("mixprec_gluon.states", r"a Gluon states file of mixprec\.mxnet \(Trainer\.save_states\)"),
        ("gluon.states", r"a pickled Gluon states file \(gluon\.Trainer\.save_states\)"),
        ("gluon.params", r"an MXNet NDArray file \(a Gluon \.params file"),
        ("torch.pt", r"a PyTorch checkpoint \(torch\.save\)"),
    ],
)
def test_another_frameworks_file_is_named(name: str, what: str, saved: Any) -> None:
    opt, state, _ = saved
    with pytest.raises(CheckpointError, match=what) as info:
        opt.load(DATA / name, like=state)
    assert "allow_pickle" not in str(info.value)
    assert "not a mixprec-jax checkpoint" in str(info.value)


def test_numpy_files_that_are_not_checkpoints(tmp_path: Path, saved: Any) -> None:
    opt, state, _ = saved
    np.save(tmp_path / "one.npy", np.ones(3))
    with pytest.raises(CheckpointError, match=r"a single NumPy array \(\.npy"):
        opt.load(tmp_path / "one.npy", like=state)
    np.savez(tmp_path / "plain.npz", *[np.asarray(x) for x in jax.tree_util.tree_leaves(state)])
    with pytest.raises(CheckpointError, match="without mixprec-jax's header"):
        opt.load(tmp_path / "plain.npz", like=state)
    opt.save_params(tmp_path / "params.npz", state)
    with pytest.raises(CheckpointError, match=r"a parameters file \(Optimizer\.save_params"):
        opt.load(tmp_path / "params.npz", like=state)
    pickled = io.BytesIO()
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(CheckpointError, match=r"a single NumPy array"):
        _load(opt, state, pickled.getvalue())


# ---------------------------------------------------------------------- sizes: zip bombs


def _members(blob: bytes) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        return [(info.filename, zf.read(info)) for info in zf.infolist()]


def _zip(members: list[tuple[str, bytes, int, int, int]]) -> bytes:
    """A zip archive written by hand: (name, stored bytes, method, CRC-32, declared
    inflated size) per member, so that a member can lie about its size."""
    out, central = bytearray(), bytearray()
    for name, payload, method, crc, size in members:
        encoded, offset = name.encode(), len(out)
        out += struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, method, 0, 0, crc, len(payload),
                           size, len(encoded), 0) + encoded + payload  # fmt: skip
        central += struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, method, 0, 0, crc,
                               len(payload), size, len(encoded), 0, 0, 0, 0, 0, offset)  # fmt: skip
        central += encoded
    count = len(members)
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, count, count, len(central), len(out), 0)
    return bytes(out + central + end)


def _stored(name: str, data: bytes) -> tuple[str, bytes, int, int, int]:
    return name, data, zipfile.ZIP_STORED, zlib.crc32(data), len(data)


MIB = 1 << 20


def _bomb(prefix: bytes, mebibytes: int) -> bytes:
    """A raw deflate stream of ``prefix`` then that many MiB of zeros (about 1 KB a MiB)."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = compressor.compress(prefix) + compressor.flush(zlib.Z_FULL_FLUSH)
    zeros = zlib.compressobj(9, zlib.DEFLATED, -15)
    chunk = zeros.compress(bytes(MIB)) + zeros.flush(zlib.Z_FULL_FLUSH)  # byte-aligned, alone
    return head + chunk * mebibytes + compressor.flush()


def _bounded(load: Any) -> tuple[CheckpointError, int]:
    """The refusal ``load()`` raises and the peak of Python's allocations meanwhile."""
    tracemalloc.start()
    try:
        load()
    except CheckpointError as exc:
        error = exc
    else:
        raise AssertionError("the bomb loaded")
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return error, peak


def _with_bomb(blob: bytes, target: str, bomb: bytes, crc: int, declared: int) -> bytes:
    return _zip(
        [
            (name, bomb, zipfile.ZIP_DEFLATED, crc, declared) if name == f"{target}.npy"
            else _stored(name, data)
            for name, data in _members(blob)
        ]
    )  # fmt: skip


def test_the_4_mb_zip_bomb_is_refused_unread(saved: Any) -> None:
    """Issue 37's bomb: 4 MB that inflate to 4 GiB (the old loader inflated it, then checked
    names). Refused by the file's own size, before the zip is parsed."""
    opt, state, blob = saved
    bomb = _bomb(b"", 4095)  # 4095 MiB: just under 4 GiB, the most a plain zip declares
    assert len(bomb) < 5 * MIB
    data = _with_bomb(blob, "weights.dense.kernel", bomb, 0, 4095 * MIB)
    error, peak = _bounded(lambda: _load(opt, state, data))
    assert "refused before reading it" in str(error)
    assert peak < 16 * MIB, peak


@pytest.mark.parametrize("target", ["weights.dense.kernel", "__meta__"])
def test_a_zip_bomb_is_refused_by_its_declared_size(target: str, saved: Any) -> None:
    """A bomb small enough to pass the file's cap (255 KB inflating to 255 MiB), honest
    about its size: refused from the central directory, before a byte is inflated."""
    opt, state, blob = saved
    members = dict(_members(blob))
    declared = 255 * MIB + sum(map(len, members.values())) - len(members[f"{target}.npy"])
    data = _with_bomb(blob, target, _bomb(b"", 255), 0, 255 * MIB)
    error, peak = _bounded(lambda: _load(opt, state, data))
    assert f"declare {declared} bytes inflated" in str(error)
    assert "refused before inflating anything" in str(error)
    assert peak < 16 * MIB, peak


def test_a_member_that_lies_about_its_size_is_read_only_that_far(saved: Any) -> None:
    """A member that declares its right size (and the CRC of that much) but inflates to 255
    MiB: the read stops at the declared size, and the checksum refuses what was read."""
    opt, state, blob = saved
    target = "weights.dense.kernel"
    data = dict(_members(blob))[f"{target}.npy"]
    header = data[: len(data) - 6 * 2]  # the .npy header of six bfloat16 values
    read = header + bytes(len(data) - len(header))
    lying = _with_bomb(blob, target, _bomb(header, 255), zlib.crc32(read), len(data))
    error, peak = _bounded(lambda: _load(opt, state, lying))
    assert "do not match the header's SHA-256" in str(error)
    assert peak < 16 * MIB, peak


def test_a_member_larger_than_its_array_is_refused_before_its_data(saved: Any) -> None:
    """The per-member cap: a header that matches the state, a declared size that does not."""
    opt, state, blob = saved
    target = "weights.dense.bias.npy"
    members = [
        (name, data + bytes(8 * MIB), zipfile.ZIP_STORED, 0, len(data) + 8 * MIB)
        if name == target else _stored(name, data)
        for name, data in _members(blob)
    ]  # fmt: skip
    # the file's own size is over the cap too: a file cap, then a member cap
    with pytest.raises(CheckpointError, match="more than a checkpoint of this state can be"):
        _load(opt, state, _zip(members))
    members = [
        (name, data, zipfile.ZIP_STORED, zlib.crc32(data), len(data) + 5000)
        if name == target else _stored(name, data)
        for name, data in _members(blob)
    ]  # fmt: skip
    with pytest.raises(CheckpointError, match=r"weights\.dense\.bias \(bfloat16\[3\]\) can take"):
        _load(opt, state, _zip(members))


# ---------------------------------------------------------------------- inf and NaN


@pytest.mark.parametrize(
    ("policy", "where"),
    [("O2-bf16", "weights"), ("O3-bf16-kahan", "weights"), ("O2-bf16", "opt_state")],
)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_state_is_refused(policy: str, where: str, bad: float) -> None:
    """Loaded, NaN weights or Adam moments reach every weight at the next step."""
    opt, state = _trained(policy, optax.adam(1e-2))
    poison = lambda x: x.at[0].set(bad) if x.ndim == 1 and x.size > 1 else x  # noqa: E731
    part = jax.tree_util.tree_map(poison, getattr(state, where))
    blob = _saved(opt, state._replace(**{where: part}))
    with pytest.raises(CheckpointError, match=r"dense\.bias holds 1 inf/NaN value") as info:
        _load(opt, state, blob)
    assert "load an earlier checkpoint" in str(info.value)


def test_a_state_that_starts_at_inf_still_loads() -> None:
    """optax's reduce_on_plateau keeps its best value at inf until the first evaluation:
    a leaf that is inf in ``like`` may be inf in the file."""
    tx = optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau())
    opt = mpj.Optimizer(tx, policy="O2-bf16")
    state = opt.init(PARAMS)
    assert not all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(state))
    blob = _saved(opt, state)
    assert _bits(_load(opt, state, blob)) == _bits(state)
    finite = jax.tree_util.tree_map(jnp.nan_to_num, state)  # a like whose best value is finite
    with pytest.raises(CheckpointError, match=r"best_value holds 1 inf/NaN"):
        _load(opt, finite, blob)


# ---------------------------------------------------------------------- flipped bytes


def _regions(blob: bytes) -> dict[str, set[int]]:
    """Byte positions by what they hold: each member's .npy header, the arrays' data, the
    JSON header's data, and the zip's own records."""
    regions: dict[str, set[int]] = {"npy header": set(), "array data": set(), "json": set()}
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        for info in zf.infolist():
            name_len, extra_len = struct.unpack("<2H", blob[info.header_offset + 26 :][:4])
            start = info.header_offset + 30 + name_len + extra_len
            header_len = 10 + struct.unpack("<H", blob[start + 8 : start + 10])[0]
            regions["npy header"] |= set(range(start, start + header_len))
            data = range(start + header_len, start + info.compress_size)
            regions["json" if info.filename == "__meta__.npy" else "array data"] |= set(data)
    regions["zip records"] = set(range(len(blob))) - set().union(*regions.values())
    return regions


@pytest.mark.parametrize("policy", ["O3-bf16-kahan", "O2-bf16"])
def test_a_flipped_byte_anywhere_never_loads_changed_numbers(policy: str) -> None:
    """Every position of the file, its bits inverted: refused, or (in zip fields no reader
    uses, such as timestamps) the very same state. Every byte of an array, a .npy header or
    the JSON header is refused."""
    opt, state = _trained(policy, optax.adam(1e-2))
    blob = _saved(opt, state)
    original = _bits(state)
    regions = _regions(blob)
    assert all(regions.values()), {k: len(v) for k, v in regions.items()}
    accepted = set()
    for position in range(len(blob)):
        flipped = bytearray(blob)
        flipped[position] ^= 0xFF
        try:
            loaded = _load(opt, state, bytes(flipped))
        except CheckpointError:
            continue
        assert _bits(loaded) == original, f"byte {position} changed the numbers and loaded"
        accepted.add(position)
    for region in ("npy header", "array data", "json"):
        assert not accepted & regions[region], (region, sorted(accepted & regions[region]))
    assert accepted <= regions["zip records"]


def _repacked(blob: bytes, change: Any) -> bytes:
    """The file written again with valid zip CRCs after ``change(name, data) -> data``: the
    checksums are all that can see the edit."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        for name, data in _members(blob):
            zf.writestr(name, change(name, data))
    return out.getvalue()


def test_an_edited_array_with_a_valid_zip_is_refused_by_the_checksum(saved: Any) -> None:
    opt, state, blob = saved

    def edit(name: str, data: bytes) -> bytes:
        if name != "weights.dense.kernel.npy":
            return data
        return data[:-1] + bytes([data[-1] ^ 0x01])  # the last bit of a bfloat16 weight

    with pytest.raises(CheckpointError, match="do not match the header's SHA-256"):
        _load(opt, state, _repacked(blob, edit))


def _edit_header(blob: bytes, change: Any) -> bytes:
    def edit(name: str, data: bytes) -> bytes:
        if name != "__meta__.npy":
            return data
        meta = change(json.loads(data[128:].decode()))
        out = io.BytesIO()
        np.save(out, np.frombuffer(json.dumps(meta).encode(), np.uint8))
        return out.getvalue()

    return _repacked(blob, edit)


def test_an_edited_header_is_refused(saved: Any) -> None:
    opt, state, blob = saved

    def lower_scale(meta: dict[str, Any]) -> dict[str, Any]:
        meta["policy"]["compute"] = "float16"
        return meta

    with pytest.raises(CheckpointError, match="header does not match its SHA-256"):
        _load(opt, state, _edit_header(blob, lower_scale))


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ([1, 2], "not a JSON object"),  # AttributeError before
        ({"format": "mixprec-jax/1", "dtypes": {}}, "policy is unreadable"),  # KeyError before
        ({"format": "mixprec-jax/1", "policy": {"compute": "int3"}, "dtypes": {}}, "unreadable"),
        ({"format": "mixprec-jax/1", "policy": {}, "dtypes": [1]}, "dtypes are unreadable"),
        ({"format": "mixprec-jax/9"}, "unknown checkpoint format 'mixprec-jax/9'"),
        ({"format": "mixprec-jax/2", "policy": {}, "dtypes": {}}, "has no checksums"),
    ],
)
def test_a_malformed_header_is_refused(header: Any, message: str, saved: Any) -> None:
    opt, state, blob = saved
    with pytest.raises(CheckpointError, match=message):
        _load(opt, state, _edit_header(blob, lambda meta: header))


def test_a_deeply_nested_header_is_refused(saved: Any) -> None:
    opt, state, blob = saved

    def nested(name: str, data: bytes) -> bytes:
        if name != "__meta__.npy":
            return data
        out = io.BytesIO()
        np.save(out, np.frombuffer(b"[" * 100_000 + b"]" * 100_000, np.uint8))
        return out.getvalue()

    with pytest.raises(CheckpointError, match="header is unreadable"):
        _load(opt, state, _repacked(blob, nested))


# ---------------------------------------------------------------------- the first format


def _legacy(opt: mpj.Optimizer, state: mpj.State) -> bytes:
    """A file as the first release wrote it: the JSON as a NumPy string, no checksums."""
    arrays, dtypes = checkpoint._arrays(state)
    meta = {"format": "mixprec-jax/1", "policy": opt.policy.to_dict(), "dtypes": dtypes}
    out = io.BytesIO()
    np.savez(out, **arrays, __meta__=np.array(json.dumps(meta)))
    return out.getvalue()


def test_files_of_the_first_format_still_load(saved: Any) -> None:
    opt, state, _ = saved
    assert _bits(_load(opt, state, _legacy(opt, state))) == _bits(state)
    poisoned = state._replace(
        weights=jax.tree_util.tree_map(lambda x: x.at[0].set(jnp.nan), state.weights)
    )
    with pytest.raises(CheckpointError, match="inf/NaN"):
        _load(opt, state, _legacy(opt, poisoned))


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    edits=st.lists(
        st.tuples(
            st.sampled_from(["set", "insert", "delete"]),
            st.floats(0, 1),
            st.binary(min_size=1, max_size=40),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_any_edit_is_refused_or_changes_nothing(
    edits: list[tuple[str, float, bytes]], saved: Any
) -> None:
    """Bytes overwritten, inserted or deleted anywhere: a CheckpointError (never another
    exception), or a file that loads the very same state."""
    opt, state, blob = saved
    data = bytearray(blob)
    for kind, where, payload in edits:
        at = int(where * (len(data) - 1))
        if kind == "set":
            data[at : at + len(payload)] = payload[: len(data) - at]
        elif kind == "insert":
            data[at:at] = payload
        else:
            del data[at : at + len(payload)]
    try:
        loaded = _load(opt, state, bytes(data))
    except CheckpointError:
        return
    assert _bits(loaded) == _bits(state)
