"""Atomic file writes: a file mixprec writes is either the old one or the whole new one.

Every file mixprec writes (Gluon parameter and trainer-state files, the advisor's report
files, event-log plots, ``mixprec_torch.save``) goes through :func:`atomic_path`: the writer
fills a temporary file in the target's own folder (same file system, so the final rename
cannot cross devices), the file is flushed to disk with ``fsync``, and ``os.replace`` puts it
in place in one step. A process killed mid-save, or a write that fails half-way (disk full,
an exception in the writer), leaves the previous file untouched and no temporary behind
(a SIGKILL may leave one ``.<name>-*.tmp`` file, never a damaged target). A target that is a
symbolic link stays one: the file it points to is replaced. Any name the file system takes
works (the temporary name keeps at most 200 bytes of it).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_path", "atomic_write_bytes", "atomic_write_text"]


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike[str], suffix: str = ".tmp") -> Iterator[str]:
    """Yield a temporary path next to ``target``; on a clean exit it replaces ``target``.

    The caller writes the whole file to the yielded path (any writer that takes a file
    name). On an exception the temporary file is removed and ``target`` is unchanged.

    :param suffix: the temporary name's ending; some writers pick the format from it
        (matplotlib's ``savefig``), so pass the target's own suffix for them.
    """
    # a symbolic link stays a link: the file it points to is the one replaced
    target = Path(os.path.realpath(os.fspath(target)))
    folder = target.parent
    fd, tmp = tempfile.mkstemp(prefix=f".{_short(target.name)}-", suffix=suffix, dir=folder)
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


#: Bytes of the target's name kept in the temporary name: with the dot, the dash, mkstemp's
#: 8 random characters and the suffix it stays under the 255 bytes most file systems allow,
#: for any target name that fits them itself.
_NAME_KEPT = 200


def _short(name: str) -> str:
    """``name`` cut to :data:`_NAME_KEPT` bytes of UTF-8 (whole characters)."""
    return name.encode("utf-8", "surrogateescape")[:_NAME_KEPT].decode("utf-8", "ignore")


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
