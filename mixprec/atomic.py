"""Atomic file writes: a file mixprec writes is either the old one or the whole new one.

Every file mixprec writes (Gluon parameter and trainer-state files, the advisor's report
files, event-log plots, ``mixprec_torch.save``, precision locks) goes through
:func:`atomic_path`: the writer fills a temporary file in the target's own folder (same file
system, so the final rename cannot cross devices), the file is flushed to disk with
``fsync``, and ``os.replace`` puts it in place in one step. A process killed mid-save, or a
write that fails half-way (disk full, an exception in the writer), leaves the previous file
untouched and no temporary behind. A target that is a symbolic link stays one: the file it
points to is replaced. Any name the file system takes works (the temporary name keeps at
most 200 bytes of it).

**What a SIGKILL leaves.** A process killed mid-save cannot remove its temporary file
(``.<name>-<pid>.<host>-<random>.tmp``: the target's name, the writing process's id, a tag
of the host and its process-id namespace). The next save to the same path removes it, and
only it: a file in the target's folder whose name is this writer's temporary name for that
target, written on this host (same tag), whose process is gone or started after the file
was last written (its id was reused). Anything else (another target's files, another
host's, a live writer's, a name the writer would not make) is never touched.

**What is refused** before anything is written, as an ``OSError`` naming the target
(callers turn it into their own error): an empty path, a folder, and an existing file that
is not a regular file (a device such as ``/dev/zero``, a pipe, a socket: replacing it with
a plain file is never what a save means).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_path", "atomic_write_bytes", "atomic_write_text"]


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike[str], suffix: str = ".tmp") -> Iterator[str]:
    """Yield a temporary path next to ``target``; on a clean exit it replaces ``target``.

    The caller writes the whole file to the yielded path (any writer that takes a file
    name). On an exception the temporary file is removed and ``target`` is unchanged.
    Temporary files an earlier save to ``target`` left when it was killed are removed first
    (see the module's docstring).

    :param suffix: the temporary name's ending; some writers pick the format from it
        (matplotlib's ``savefig``), so pass the target's own suffix for them.
    :raises OSError: ``target`` is empty, a folder, or not a regular file
        (``IsADirectoryError``, ``FileNotFoundError``, ``OSError(EINVAL)``), or its folder
        cannot hold a new file; nothing was written.
    """
    target = _checked(target)
    folder = target.parent
    head, tag = f".{_short(target.name)}-", _host_tag()
    _remove_stale(folder, head, tag, suffix)
    prefix = f"{head}{os.getpid()}.{tag}-"  # mkstemp adds 8 random characters and suffix
    try:
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=folder)
    except OSError as err:
        raise type(err)(
            err.errno, f"cannot create a file in {os.fspath(folder)!r} ({err.strerror})",
            os.fspath(target),
        ) from None  # fmt: skip
    os.close(fd)
    try:
        # mkstemp makes the file private (0600); give it the mode a plain open() would
        os.chmod(tmp, _mode_for(target))
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(folder)


def atomic_write_bytes(target: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``target`` atomically (see :func:`atomic_path`)."""
    with atomic_path(target) as tmp, open(tmp, "wb") as f:
        f.write(data)


def atomic_write_text(target: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``target`` atomically (see :func:`atomic_path`)."""
    atomic_write_bytes(target, text.encode("utf-8"))


def _checked(target: str | os.PathLike[str]) -> Path:
    """``target`` with symbolic links resolved, refused when no file can be saved there."""
    given = os.fspath(target)
    if not given:
        raise FileNotFoundError(errno.ENOENT, "an empty path names no file to save to", given)
    # a symbolic link stays a link: the file it points to is the one replaced
    path = Path(os.path.realpath(given))
    try:
        mode = path.stat().st_mode
    except OSError:
        return path  # nothing there yet (or unreadable: mkstemp and replace will say)
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(
            errno.EISDIR, "is a folder; save to the path of a file (in that folder)", given
        )
    if not stat.S_ISREG(mode):
        raise OSError(
            errno.EINVAL,
            "is not a regular file (a device, a pipe or a socket), which a save would "
            "replace with a plain file; save to the path of a file",
            given,
        )
    return path


#: Bytes of the target's name kept in the temporary name: with the dot, the process id (at
#: most 7 digits), the host tag, the dashes, mkstemp's 8 random characters and the suffix
#: it stays under the 255 bytes most file systems allow, for any target name that fits them.
_NAME_KEPT = 200

#: What follows the target's name in a temporary name: ``-<pid>.<host tag>-<8 random>``.
_TAIL = re.compile(r"(\d{1,10})\.([0-9a-f]{8})-[a-z0-9_]{8}")


def _short(name: str) -> str:
    """``name`` cut to :data:`_NAME_KEPT` bytes of UTF-8 (whole characters)."""
    return name.encode("utf-8", "surrogateescape")[:_NAME_KEPT].decode("utf-8", "ignore")


def _host_tag() -> str:
    """8 hex digits naming this host and process-id namespace: a process id read in a
    temporary name means this process only where the tag is this one (a shared folder on
    another machine or container has other processes under the same numbers)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    text = f"{socket.gethostname()}|{namespace}"
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:8]


def _remove_stale(folder: Path, head: str, tag: str, suffix: str) -> None:
    """Remove the temporary files of killed saves to this target (never anything else):
    ``<head><pid>.<tag>-<8 random><suffix>`` whose writer is gone."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        name = entry.name
        if not (name.startswith(head) and name.endswith(suffix)):
            continue
        found = _TAIL.fullmatch(name[len(head) : len(name) - len(suffix)])
        if found is None or found[2] != tag:
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode) and _writer_gone(int(found[1]), info.st_mtime):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


def _writer_gone(pid: int, written: float) -> bool:
    """Whether process ``pid``, which wrote a file last at ``written``, is certainly gone:
    no such process, or one that started after the write (the number was reused). Where it
    cannot be told (not POSIX, no start time), the writer may be alive: False."""
    if os.name != "posix" or pid <= 0:
        return False  # os.kill(pid, 0) would terminate the process on Windows
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, another user's
    except OSError:
        return False
    started = _start_time(pid)
    # the boot time is known to the second: a margin keeps a file written just before a
    # process of that number started (it would be that process's) from being taken
    return started is not None and written < started - 2.0


def _start_time(pid: int) -> float | None:
    """When process ``pid`` started, in seconds since the epoch (Linux ``/proc``), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        with open("/proc/stat", "rb") as f:
            boot = next(line for line in f if line.startswith(b"btime "))
        ticks = os.sysconf("SC_CLK_TCK")
        return int(boot.split()[1]) + int(fields[19]) / ticks
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _mode_for(target: Path) -> int:
    try:
        return target.stat().st_mode & 0o7777
    except OSError:
        return 0o666 & ~_UMASK


def _read_umask() -> int:
    # os.umask can only be read by setting it; done once, at import, before any thread runs
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def _fsync_file(path: str) -> None:
    # the data must be on disk before the rename makes it the file's content
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(folder: Path) -> None:
    # makes the rename itself durable; not every platform can open a folder (Windows)
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
