"""``mixprec.torch.save`` seals a checkpoint with a checksum and ``mixprec.torch.load`` refuses
a changed byte, a cut, a foreign file and a zip record that would inflate or reach past the
end, before anything is read whole (issue 37, build item 6)."""

from __future__ import annotations

import hashlib
import io
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import mixprec  # noqa: E402
import mixprec.torch as mpt  # noqa: E402
from mixprec.errors import CheckpointError  # noqa: E402


def _checkpoint() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = mpt.wrap(model, optimizer, policy="O2")
    loss = model(torch.randn(3, 4)).float().sum()
    with mpt.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    state = _checkpoint()
    path = tmp_path_factory.mktemp("ckpt") / "ckpt.pt"
    mpt.save(state, path)
    return path, state


def test_a_sealed_checkpoint_loads_whole_and_torch_load_still_reads_it(
    saved: tuple[Path, dict[str, Any]],
) -> None:
    path, state = saved
    assert _same(mpt.load(path), state)
    assert _same(torch.load(path, weights_only=True), state)  # still torch's own format
    assert path.read_bytes()[-79:].startswith(b"mixprec-sha256:")
    buffer = io.BytesIO()
    mpt.save(state, buffer)
    assert buffer.getvalue()[-79:].startswith(b"mixprec-sha256:")  # a file object: sealed too
    buffer.seek(0)
    assert _same(mpt.load(buffer), state)


def test_every_flipped_byte_is_refused(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """Run as found, on every byte: a flipped byte loaded silently with changed numbers (the
    format had no checksum), or failed with whatever error the byte reached."""
    data = saved[0].read_bytes()
    damaged = tmp_path / "flipped.pt"
    for at in range(len(data)):
        flipped = bytearray(data)
        flipped[at] ^= 0x01 if at % 2 else 0x80
        damaged.write_bytes(bytes(flipped))
        with pytest.raises(CheckpointError, match="is damaged"):
            mpt.load(damaged)


@pytest.mark.parametrize("keep", [0, 10, 21, 100, -1, -79, -80, -101])
def test_a_cut_checkpoint_is_refused(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path, keep: int
) -> None:
    data = saved[0].read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[:keep])
    with pytest.raises(CheckpointError, match=r"cut short|damaged|no mixprec checksum"):
        mpt.load(cut)


def test_a_plain_torch_save_file_is_refused_with_the_way_to_load_it(tmp_path: Path) -> None:
    path = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(3)}, path)
    with pytest.raises(CheckpointError, match=r"no mixprec checksum.*torch\.load"):
        mpt.load(path)


def _sealed_zip(entries: dict[str, bytes], compression: int) -> bytes:
    """A zip sealed the way mixprec.torch.save seals: a checksum in its comment."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression) as archive:
        for name, payload in entries.items():
            archive.writestr(name, payload)
    data = bytearray(buffer.getvalue())
    data[-2:] = struct.pack("<H", 79)
    return bytes(data) + b"mixprec-sha256:" + hashlib.sha256(data).hexdigest().encode()


def test_a_compressed_record_is_refused_before_it_is_inflated(tmp_path: Path) -> None:
    """A 64 MiB record in about 64 KiB, with a valid checksum: refused from the zip
    directory, never inflated."""
    bomb = tmp_path / "bomb.pt"
    bomb.write_bytes(_sealed_zip({"archive/data.pkl": b"\0" * (64 << 20)}, zipfile.ZIP_DEFLATED))
    assert bomb.stat().st_size < 1 << 20
    with pytest.raises(CheckpointError, match="compressed or reaches past"):
        mpt.load(bomb)


def test_a_record_reaching_past_the_end_is_refused(tmp_path: Path) -> None:
    data = bytearray(_sealed_zip({"archive/data.pkl": b"x" * 64}, zipfile.ZIP_STORED))
    central = data.rindex(b"PK\x01\x02")  # the central directory's entry: sizes at 20 and 24
    data[central + 20 : central + 28] = struct.pack("<II", 1 << 30, 1 << 30)
    body = bytes(data[:-79])
    sealed = body + b"mixprec-sha256:" + hashlib.sha256(body).hexdigest().encode()
    path = tmp_path / "long.pt"
    path.write_bytes(sealed)
    with pytest.raises(CheckpointError, match="reaches past"):
        mpt.load(path)


def test_the_legacy_format_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"previous")
    with pytest.raises(CheckpointError, match="_use_new_zipfile_serialization"):
        mpt.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    assert path.read_bytes() == b"previous" and sorted(tmp_path.iterdir()) == [path]


def test_a_file_object_that_cannot_seek_or_does_not_start_the_file_is_refused(
    saved: tuple[Path, dict[str, Any]],
) -> None:
    class Pipe(io.RawIOBase):
        def readable(self) -> bool:
            return True

        def seekable(self) -> bool:
            return False

    with pytest.raises(CheckpointError, match="cannot seek"):
        mpt.load(Pipe())
    buffer = io.BytesIO(b"header" + saved[0].read_bytes())
    buffer.seek(6)
    with pytest.raises(CheckpointError, match="at byte 6"):
        mpt.load(buffer)


def test_load_is_a_public_name_of_the_facade() -> None:
    assert "load" in mixprec.torch.__all__ and mixprec.torch.load is mpt.load
