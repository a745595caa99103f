"""The developer build of the kernels: ``MIXPREC_NATIVE_BUILD=1`` compiles ``_cpu_kernels.c``
at first use into a private cache instead of loading the installed library.

For whoever edits the C (no reinstall after each edit) and for the sanitizer run (``make
sanitize``: ``MIXPREC_NATIVE_CFLAGS`` adds flags). Users never need it: the wheel ships the
library (``setup.py``).

- **The compiler**: ``$CC``, split as a shell would (``gcc -std=c11``, ``ccache gcc``), or the
  first of ``cc``, ``gcc``, ``clang`` on ``PATH``; the source's own flags
  (:func:`~.libfile.source_facts`), never ``-march=native``. A compiler that does not finish
  within ``MIXPREC_NATIVE_BUILD_TIMEOUT`` seconds (60) is killed with its children.
- **The cache**: ``$MIXPREC_CACHE_DIR``, else ``$XDG_CACHE_HOME/mixprec``, else
  ``~/.cache/mixprec``, created with mode 0700. It must belong to this user and be writable by
  nobody else, and so must every file loaded from it (:func:`~.libfile.check_folder`,
  :func:`~.libfile.open_library`); otherwise the build goes to a fresh private
  :func:`tempfile.mkdtemp` folder, removed at exit, and the note says so.
- **A build** is named by a hash of the source, the compiler, its version and the flags;
  written to a temporary name, synced, checked as any library is (a compiler that exits 0
  but writes garbage never reaches the cache), then renamed into place, so concurrent
  processes (DDP ranks) and a crash mid-write leave either no file or a whole one. A file
  under that name that fails the checks (cut short, not ours) is rebuilt over.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import platform
import shlex
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .libfile import SOURCE, SourceFacts, Untrusted, check_folder, open_library

__all__ = ["BuildFailed", "Built", "build", "cache_dir", "compiler", "flags"]

DEFAULT_TIMEOUT = 60.0


class BuildFailed(Exception):
    """The developer build could not give a library; the message says why."""


@dataclass
class Built:
    """A checked library of the developer build, open for loading."""

    path: Path
    fd: int
    """An open descriptor of the checked file (load it, then close it)."""
    notes: list[str] = field(default_factory=list)
    """What the user should hear once (a refused cache folder)."""


def cache_dir() -> Path:
    """The developer build's cache folder (it may not exist yet)."""
    explicit = os.environ.get("MIXPREC_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mixprec"


def compiler() -> list[str]:
    """The compiler's command: ``$CC`` split into words, or ``cc``/``gcc``/``clang``.

    :raises BuildFailed: there is none.
    """
    named = os.environ.get("CC", "").strip()
    if named:
        try:
            words = shlex.split(named)
        except ValueError as exc:
            raise BuildFailed(f"cannot read CC={named!r}: {exc}") from None
        found = shutil.which(words[0]) if words else None
        if found is None:
            raise BuildFailed(f"the C compiler CC={named!r} is not found")
        return [found, *words[1:]]
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return [found]
    raise BuildFailed("no C compiler found ($CC, cc, gcc, clang)")


def flags(facts: SourceFacts) -> list[str]:
    """The flags of a developer build: the source's, then ``$MIXPREC_NATIVE_CFLAGS``."""
    extra = shlex.split(os.environ.get("MIXPREC_NATIVE_CFLAGS", ""))
    return [*facts.cflags, "-fPIC", "-shared", facts.define(), *extra]


def _timeout() -> float:
    try:
        return float(os.environ.get("MIXPREC_NATIVE_BUILD_TIMEOUT", DEFAULT_TIMEOUT))
    except ValueError:
        return DEFAULT_TIMEOUT


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``command``; past ``timeout`` kill it and everything it started.

    :raises BuildFailed: it could not start or did not finish.
    """
    try:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: killed with its children
        )
    except OSError as exc:
        raise BuildFailed(f"cannot run {command[0]}: {exc}") from None
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
        proc.communicate()
        raise BuildFailed(
            f"{shlex.join(command[:2])} ... did not finish within {timeout:g} s "
            "(MIXPREC_NATIVE_BUILD_TIMEOUT); killed"
        ) from None
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _version(cc: list[str]) -> str:
    done = _run([*cc, "--version"], min(_timeout(), 30.0))
    return done.stdout.splitlines()[0] if done.stdout else ""


def _private_folder(notes: list[str]) -> Path:
    """The cache folder if it is private, else a fresh private temporary one (noted)."""
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        check_folder(folder, own=True)
        return folder
    except (OSError, Untrusted) as exc:
        temp = Path(tempfile.mkdtemp(prefix="mixprec-kernels-"))
        atexit.register(shutil.rmtree, temp, ignore_errors=True)
        notes.append(f"the kernel cache is refused ({exc}): built into the private folder {temp}")
        return temp


def build(facts: SourceFacts) -> Built:
    """Find or compile the developer build of the kernels (see the module docstring).

    :raises BuildFailed: no compiler, the build failed, timed out or wrote no library.
    """
    cc = compiler()
    args = flags(facts)
    version = _version(cc)
    key = hashlib.sha256(
        "\0".join([facts.source_id, *cc, version, *args, platform.machine()]).encode()
    ).hexdigest()[:24]
    notes: list[str] = []
    folder = _private_folder(notes)
    target = folder / f"mixprec-kernels-{key}.so"
    if os.path.lexists(target):
        try:
            return Built(target, open_library(target, own=True), notes)
        except Untrusted as exc:
            notes.append(f"{exc}: rebuilt")
    fd, name = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=folder)
    os.close(fd)
    tmp = Path(name)
    try:
        done = _run([*cc, *args, "-o", str(tmp), str(SOURCE)], _timeout())
        if done.returncode != 0:
            raise BuildFailed(
                f"{shlex.join(cc)} could not compile {SOURCE.name}: {done.stderr.strip()[-600:]}"
            )
        os.chmod(tmp, 0o700)  # the compiler may have made it anew under the umask
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            checked = open_library(tmp, own=True)
        except Untrusted as exc:
            raise BuildFailed(
                f"{shlex.join(cc)} exited 0 but wrote no usable library: {exc}"
            ) from None
        os.replace(tmp, target)  # the descriptor still names the checked file
        _sync_folder(folder)
        return Built(target, checked, notes)
    finally:
        if tmp.exists():
            tmp.unlink()


def _sync_folder(folder: Path) -> None:
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
