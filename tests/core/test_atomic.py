"""Atomic writes: a file mixprec writes is the old one or the whole new one, never a mix."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import mixprec
from mixprec.atomic import atomic_path, atomic_write_bytes, atomic_write_text
from mixprec.events import EventLog, ScaleEvent
from mixprec.testing.faults import file_size_limit, kill_while_saving, leftovers

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX faults")

OLD = b"old good checkpoint\n" * 100


def test_replaces_the_file_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    target.write_bytes(OLD)
    atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"new"
    atomic_write_text(target, "text ü")
    assert target.read_text(encoding="utf-8") == "text ü"
    assert leftovers(tmp_path, "f.bin") == []


def test_a_new_file_gets_the_mode_open_would_give(tmp_path: Path) -> None:
    mask = os.umask(0o022)
    os.umask(mask)
    atomic_write_bytes(tmp_path / "new.bin", b"x")
    assert stat.S_IMODE((tmp_path / "new.bin").stat().st_mode) == 0o666 & ~mask
    (tmp_path / "kept.bin").write_bytes(b"x")
    (tmp_path / "kept.bin").chmod(0o640)
    atomic_write_bytes(tmp_path / "kept.bin", b"y")
    assert stat.S_IMODE((tmp_path / "kept.bin").stat().st_mode) == 0o640


def test_a_write_failing_half_way_keeps_the_previous_file(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    target.write_bytes(OLD)
    with file_size_limit(1000), pytest.raises(OSError):
        atomic_write_bytes(target, b"\x01" * 100_000)  # the disk "fills" after 1000 bytes
    assert target.read_bytes() == OLD
    assert leftovers(tmp_path, "f.bin") == []


def test_a_writer_raising_keeps_the_previous_file(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    target.write_bytes(OLD)
    with pytest.raises(ZeroDivisionError), atomic_path(target) as tmp:
        Path(tmp).write_bytes(b"half")
        _ = 1 / 0
    assert target.read_bytes() == OLD
    assert leftovers(tmp_path, "f.bin") == []


def test_a_kill_during_the_save_keeps_a_whole_file(tmp_path: Path) -> None:
    target = tmp_path / "big.bin"
    a, b = b"a" * 8_000_000, b"b" * 8_000_000
    script = textwrap.dedent(f"""
        from mixprec.atomic import atomic_write_bytes
        atomic_write_bytes({str(target)!r}, b"a" * 8_000_000)
        print("ready", flush=True)
        while True:
            atomic_write_bytes({str(target)!r}, b"b" * 8_000_000)
            atomic_write_bytes({str(target)!r}, b"a" * 8_000_000)
    """)
    for delay in (0.05, 0.13, 0.31):
        kill_while_saving(script, delay)
        assert target.read_bytes() in (a, b)


def test_event_log_plot_failing_half_way_keeps_the_previous_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    log = EventLog()
    log.record(3, ScaleEvent("skip", 1024.0, 512.0))
    target = tmp_path / "scale.png"
    log.plot(target)
    before = target.read_bytes()
    log.record(9, ScaleEvent("growth", 512.0, 1024.0))
    with file_size_limit(len(before) // 2), pytest.raises(OSError):
        log.plot(target)
    assert target.read_bytes() == before
    assert leftovers(tmp_path, "scale.png") == []


def test_advice_report_files_failing_half_way_keep_the_previous_ones(tmp_path: Path) -> None:
    from mixprec.advisor.report import AdviceReport, PolicyRun

    def report(reason: str) -> AdviceReport:
        runs = [PolicyRun("O0", step_times=[0.01] * 3, losses=[1.0], loss_scales=[1.0])]
        return AdviceReport(backend="numpy", device="cpu", recommended="O0", reason=reason,
                            runs=runs, memory_measure="RSS", steps=1, tolerance=0.05,
                            threshold=0.01,
                            recommended_toml=mixprec.get_policy("O0").to_toml())  # fmt: skip

    first = report("first")
    (tmp_path / "report.json").write_text(first.to_json(), encoding="utf-8")
    first.write_toml(tmp_path / "recommended.toml")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with file_size_limit(10), pytest.raises(OSError):
        report("second " * 100).write_toml(tmp_path / "recommended.toml")
    with file_size_limit(10), pytest.raises(OSError):
        report("second " * 100).save(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


# ---------------------------------------------------------------------- issue 21


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else set()


def test_the_file_and_then_its_folder_are_fsynced_and_nothing_stays_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The data reaches the disk before the rename, the rename itself after it."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        mode = os.fstat(fd).st_mode
        synced.append("folder" if stat.S_ISDIR(mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    before = _open_fds()
    atomic_write_bytes(tmp_path / "f.bin", b"new")
    assert synced == ["file", "folder"]
    assert _open_fds() == before  # the temporary's and the folder's descriptors are closed


def test_the_file_is_fsynced_before_it_replaces_the_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    order: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (order.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(
        os, "replace", lambda a, b: (order.append("replace"), real_replace(a, b))[1]
    )
    atomic_write_bytes(tmp_path / "f.bin", b"new")
    assert order == ["fsync", "replace", "fsync"]


def test_a_symbolic_link_stays_a_link_to_the_new_content(tmp_path: Path) -> None:
    """``mixprec.torch.save`` through a link (``latest.pt -> run3/ckpt.pt``) replaced the link
    with a file; the link now stays and its target gets the new bytes."""
    (tmp_path / "run3").mkdir()
    real = tmp_path / "run3" / "ckpt.pt"
    real.write_bytes(OLD)
    link = tmp_path / "latest.pt"
    link.symlink_to(Path("run3") / "ckpt.pt")
    atomic_write_bytes(link, b"new")
    assert link.is_symlink() and real.read_bytes() == b"new"
    assert leftovers(tmp_path / "run3", "ckpt.pt") == [] and leftovers(tmp_path, "latest.pt") == []


@pytest.mark.parametrize("length", [200, 242, 250, 255])
def test_names_up_to_the_file_system_limit_are_written(tmp_path: Path, length: int) -> None:
    """torch.save accepts a 255-byte name; the temporary name must fit beside it."""
    target = tmp_path / ("é" * (length // 2) + "x" * (length % 2))
    assert len(target.name.encode()) == length
    target.write_bytes(OLD)
    atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]


def test_the_temporary_name_keeps_at_most_200_bytes_of_the_target_name(tmp_path: Path) -> None:
    with atomic_path(tmp_path / ("é" * 127)) as tmp:
        name = Path(tmp).name.encode()
        Path(tmp).write_bytes(b"x")
    # the dot, 200 bytes (100 whole characters), the dash, the pid, the dot, the host tag,
    # the dash, 8 random characters, ".tmp"
    pid = len(str(os.getpid()))
    assert len(name) == 1 + 200 + 1 + pid + 1 + 8 + 1 + 8 + 4
    assert name.startswith(b"." + "é".encode() * 100 + b"-")
    with atomic_path(tmp_path / ("a" * 199 + "é")) as tmp:  # a character cut in half is dropped
        assert Path(tmp).name.startswith("." + "a" * 199 + "-")
        Path(tmp).write_bytes(b"x")


def test_the_temporary_name_keeps_the_target_name_and_the_suffix(tmp_path: Path) -> None:
    with atomic_path(tmp_path / "plot.png", suffix=".png") as tmp:
        name = Path(tmp).name
        Path(tmp).write_bytes(b"png")
    assert name.startswith(".plot.png-") and name.endswith(".png")
    with atomic_path(tmp_path / "f.bin") as tmp:
        assert Path(tmp).name.endswith(".tmp") and Path(tmp).parent == tmp_path
        Path(tmp).write_bytes(b"x")


def test_reading_the_umask_at_import_puts_it_back(tmp_path: Path) -> None:
    """mixprec.atomic reads the umask by setting it; the process's own must stay."""
    script = "import os; os.umask(0o077); import mixprec.atomic; print(oct(os.umask(0)))"
    done = subprocess.run(  # run elsewhere: the import is the installed mixprec's
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    assert done.stdout.strip() == "0o77"


def test_a_name_with_bytes_that_are_no_utf8_is_written(tmp_path: Path) -> None:
    """A file name from ``os.listdir`` may hold undecodable bytes (as surrogates)."""
    target = tmp_path / os.fsdecode(b"ckpt-\xff.pt")
    atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"new"
    assert os.listdir(os.fsencode(tmp_path)) == [b"ckpt-\xff.pt"]


# ---------------------------------------------------------------------- issue 37


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_killed_save_leaves_a_temporary_that_the_next_save_removes(tmp_path: Path) -> None:
    """A SIGKILLed save left its 33 MB temporary file behind for ever (issue 37)."""
    target = tmp_path / "ckpt.pt"
    target.write_bytes(OLD)
    script = textwrap.dedent(f"""
        import time
        from mixprec.atomic import atomic_path
        with atomic_path({str(target)!r}) as tmp:
            with open(tmp, "wb") as f:
                f.write(b"n" * 4_000_000)
            print("ready", flush=True)  # killed now, mid-save
            time.sleep(120)
    """)
    kill_while_saving(script, 0.0)
    left = leftovers(tmp_path, "ckpt.pt")
    assert len(left) == 1 and (tmp_path / left[0]).stat().st_size == 4_000_000
    assert target.read_bytes() == OLD
    atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"new"
    assert leftovers(tmp_path, "ckpt.pt") == []


def test_the_next_save_removes_only_the_temporaries_of_gone_writers(tmp_path: Path) -> None:
    from mixprec.atomic import _host_tag

    tag, dead = _host_tag(), _dead_pid()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time_now = os.path.getmtime(tmp_path)
        kept = {
            f".f.bin-{live.pid}.{tag}-abcd1234.tmp": None,  # a live writer's
            f".f.bin-{dead}.{'0' * 8 if tag != '0' * 8 else '1' * 8}-abcd1234.tmp": None,  # host
            f".g.bin-{dead}.{tag}-abcd1234.tmp": None,  # another target's
            f".f.bin-{dead}.{tag}-ABCD1234.tmp": None,  # not a name mkstemp makes
            f".f.bin-{dead}.{tag}-abcd1234.png": None,  # another suffix
            f".f.bin-{dead}.{tag}-abcd1234": None,  # no suffix
            f"f.bin-{dead}.{tag}-abcd1234.tmp": None,  # not hidden
            f".f.bin-{dead}.{tag}-abcd12345.tmp": None,  # 9 random characters
            "notes.txt": None,
        }
        removed = {
            f".f.bin-{dead}.{tag}-abcd1234.tmp": None,  # a killed writer's
            f".f.bin-{live.pid}.{tag}-zz__9876.tmp": time_now - 3600,  # the pid was reused
        }
        for name, mtime in {**kept, **removed}.items():
            (tmp_path / name).write_bytes(b"partial")
            if mtime is not None:
                os.utime(tmp_path / name, (mtime, mtime))
        folder = tmp_path / f".f.bin-{dead}.{tag}-dir00000.tmp"
        folder.mkdir()  # a folder is never removed, whatever its name
        atomic_write_bytes(tmp_path / "f.bin", b"new")
        left = {p.name for p in tmp_path.iterdir()}
        assert left == {*kept, folder.name, "f.bin"}
    finally:
        live.kill()
        live.wait()


def test_a_temporary_being_written_by_another_thread_is_kept(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    with atomic_path(target) as tmp:
        Path(tmp).write_bytes(b"half")
        atomic_write_bytes(target, b"other save")  # the same process, the same target
        assert Path(tmp).read_bytes() == b"half"
    assert target.read_bytes() == b"half" and leftovers(tmp_path, "f.bin") == []


@pytest.mark.parametrize("kind", ["empty", "folder", "fifo"])
def test_a_target_that_is_no_file_is_refused_before_anything_is_written(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``lock -o`` a folder or ``''`` was a traceback after a temporary file was made (in the
    folder's parent: for ``-o /tmp``, in ``/``); a device or a pipe would be replaced by a
    plain file."""
    monkeypatch.chdir(tmp_path)
    target = {"empty": "", "folder": str(tmp_path / "out"), "fifo": str(tmp_path / "pipe")}[kind]
    if kind == "folder":
        (tmp_path / "out").mkdir()
    if kind == "fifo":
        os.mkfifo(target)
    before = sorted(p.name for p in tmp_path.parent.iterdir())
    inside = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(OSError) as caught:
        atomic_write_bytes(target, b"new")
    assert caught.value.filename == target
    expected = {"empty": FileNotFoundError, "folder": IsADirectoryError, "fifo": OSError}[kind]
    assert type(caught.value) is expected
    assert sorted(p.name for p in tmp_path.parent.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == inside
    if kind == "fifo":
        assert stat.S_ISFIFO(os.stat(target).st_mode)


def test_a_folder_that_cannot_hold_a_file_names_the_target(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as caught:
        atomic_write_bytes(tmp_path / "missing" / "f.bin", b"new")
    assert caught.value.filename == str(tmp_path / "missing" / "f.bin")
    assert "cannot create a file in" in str(caught.value)
