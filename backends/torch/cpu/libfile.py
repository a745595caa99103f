"""The kernel library's files: what ``_cpu_kernels.c`` says about itself, and what a library
file must be before anything loads it.

**The source's facts.** The C file is the one copy of its ABI number (``#define MP_ABI``) and of
its build flags (the ``mixprec-cflags:`` line); :func:`source_facts` reads both, and the id
of the source (a sha-256 prefix) that every build compiles in and the loader compares.
``setup.py`` loads this module by its path (it needs the standard library only) so the
installed library and the developer build use the same flags.

**What a library file must be** (:func:`open_library`), checked on an open file descriptor
before ``dlopen`` (which runs a library's constructors: loading *is* running it):

- a regular file reached without following a symbolic link, in a folder that is no link
  either (:func:`check_folder`);
- writable by nobody but its owner (not group- or world-writable), the folder too;
- for the developer cache: owned by this user, the folder too;
- a complete shared library for this interpreter's machine: the ELF header of a shared
  object of the same class, byte order and machine as the running Python, every segment the
  loader maps and the section table within the file's size (a file cut short, by a full disk
  or a crash before the rename, would kill the process with SIGBUS when a page past its end
  is touched; a compiler that wrote garbage gives no ELF header at all).

The caller then loads ``/proc/self/fd/<fd>`` (:func:`load_path`): the very file that was
checked, whatever happens to its name in the meantime.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "LIBRARY",
    "SOURCE",
    "SYMBOLS",
    "SourceFacts",
    "Untrusted",
    "check_folder",
    "load_path",
    "open_library",
    "source_facts",
]

SOURCE = Path(__file__).with_name("_cpu_kernels.c")
#: The installed library's file name, beside this module (setup.py builds it there).
LIBRARY = "_mixprec_kernels.so"
#: Every symbol the Python calls: a library lacking one is not loaded for use.
SYMBOLS = (
    "mp_abi_version",
    "mp_source_id",
    "mp_isa",
    "mp_isa_clones",
    "mp_guard",
    "mp_update",
    "mp_round_sr",
    "mp_noise",
    "mp_lowbit_index",
    "mp_lowbit_quantize",
    "mp_lowbit_dequantize",
    "mp_lowbit_update",
    "mp_maxabs",
)

_ABI = re.compile(rb"^#define MP_ABI (\d+)\s*$", re.M)
_CFLAGS = re.compile(rb"^[ \t/*]*mixprec-cflags:[ \t]*(-[^\n*]*)$", re.M)


@dataclass(frozen=True)
class SourceFacts:
    """What the C source fixes for every build of it."""

    abi: int
    """``MP_ABI``: the library's ``mp_abi_version()`` must return it."""
    cflags: tuple[str, ...]
    """The compiler flags of every build (no ``-march``: the ISA is chosen at run time)."""
    source_id: str
    """The sha-256 prefix of the source, compiled in as ``MP_SOURCE_ID``."""

    def define(self) -> str:
        """The ``-D`` flag that compiles :attr:`source_id` in."""
        return f'-DMP_SOURCE_ID="{self.source_id}"'


def source_facts(path: Path = SOURCE) -> SourceFacts:
    """Read the ABI number, the flags and the id of the C source at ``path``.

    :raises OSError: the file cannot be read.
    :raises ValueError: it lacks the ``#define MP_ABI`` or the ``mixprec-cflags:`` line.
    """
    text = path.read_bytes()
    abi = _ABI.search(text)
    flags = _CFLAGS.search(text)
    if abi is None or flags is None:
        raise ValueError(f"{path} has no '#define MP_ABI' or 'mixprec-cflags:' line")
    return SourceFacts(
        abi=int(abi.group(1)),
        cflags=tuple(flags.group(1).decode().split()),
        source_id=hashlib.sha256(text).hexdigest()[:16],
    )


class Untrusted(Exception):
    """A library file or folder that must not be loaded from; the message says why."""


def _writable_by_others(mode: int) -> bool:
    return bool(mode & (stat.S_IWGRP | stat.S_IWOTH))


def check_folder(folder: Path, *, own: bool) -> None:
    """Refuse a folder that is a symbolic link, not a folder, writable by group or world, or
    (``own``) not this user's.

    :raises Untrusted: saying which.
    """
    try:
        info = os.lstat(folder)
    except OSError as exc:
        raise Untrusted(f"cannot stat the folder {folder}: {exc}") from None
    if stat.S_ISLNK(info.st_mode):
        raise Untrusted(f"the folder {folder} is a symbolic link")
    if not stat.S_ISDIR(info.st_mode):
        raise Untrusted(f"{folder} is not a folder")
    if _writable_by_others(info.st_mode):
        raise Untrusted(
            f"the folder {folder} is writable by others (mode {stat.S_IMODE(info.st_mode):o})"
        )
    if own and info.st_uid != os.geteuid():
        raise Untrusted(f"the folder {folder} belongs to user id {info.st_uid}, not this user")


def open_library(path: Path, *, own: bool) -> int:
    """Open ``path`` for loading and check it (see the module docstring); the caller owns
    the returned descriptor and loads :func:`load_path` of it.

    :param own: the file must belong to this user (the developer cache); the installed
        library belongs to whoever installed the package.
    :raises Untrusted: saying what is wrong with the file.
    """
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if os.path.islink(path):
            raise Untrusted(f"{path} is a symbolic link") from None
        raise Untrusted(f"cannot open {path}: {exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise Untrusted(f"{path} is not a regular file")
        if _writable_by_others(info.st_mode):
            raise Untrusted(f"{path} is writable by others (mode {stat.S_IMODE(info.st_mode):o})")
        if own and info.st_uid != os.geteuid():
            raise Untrusted(f"{path} belongs to user id {info.st_uid}, not this user")
        _check_binary(fd, info.st_size, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def load_path(fd: int, path: Path) -> str:
    """The name to ``dlopen``: the checked descriptor itself where the system names open
    files (``/proc/self/fd``), else ``path``."""
    by_fd = f"/proc/self/fd/{fd}"
    return by_fd if os.path.exists(by_fd) else str(path)


# ------------------------------------------------------------------ the file's format

_ELF_MAGIC = b"\x7fELF"
_MACHO_MAGICS = {b"\xcf\xfa\xed\xfe", b"\xfe\xed\xfa\xcf", b"\xce\xfa\xed\xfe", b"\xfe\xed\xfa\xce"}
_ET_DYN = 3
_PT_LOAD = 1
_PT_DYNAMIC = 2


def _read(fd: int, offset: int, size: int) -> bytes:
    return os.pread(fd, size, offset)


def _interpreter_header() -> bytes | None:
    """The running interpreter's ELF identification and machine (what a library must match)."""
    for candidate in ("/proc/self/exe", sys.executable):
        try:
            with open(candidate, "rb") as f:
                head = f.read(20)
        except OSError:
            continue
        if head[:4] == _ELF_MAGIC:
            return head
    return None


def _check_binary(fd: int, size: int, path: Path) -> None:
    head = _read(fd, 0, 64)
    if head[:4] == _ELF_MAGIC:
        _check_elf(fd, size, head, path)
    elif sys.platform == "darwin" and head[:4] in _MACHO_MAGICS:
        return  # Mach-O: the dynamic loader checks it; no SIGBUS cases known
    else:
        raise Untrusted(f"{path} is not a shared library (no ELF header)")


def _check_elf(fd: int, size: int, head: bytes, path: Path) -> None:
    cls, data = head[4], head[5]
    if cls not in (1, 2) or data not in (1, 2):
        raise Untrusted(f"{path}: unknown ELF class or byte order")
    order = "<" if data == 1 else ">"
    wide = cls == 2
    header = order + ("HHIQQQIHHHHHH" if wide else "HHIIIIIHHHHHH")
    needed = 16 + struct.calcsize(header)
    if len(head) < needed or size < needed:
        raise Untrusted(f"{path} is cut short (its ELF header is incomplete)")
    (e_type, _, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum, _) = (
        struct.unpack_from(header, head, 16)
    )
    reference = _interpreter_header()
    if reference is not None and (reference[4:6] != head[4:6] or reference[18:20] != head[18:20]):
        raise Untrusted(f"{path} is built for another machine than this Python's")
    if e_type != _ET_DYN:
        raise Untrusted(f"{path} is not a shared object (ELF type {e_type})")
    program = order + ("IIQQQQQQ" if wide else "IIIIIIII")
    if phnum == 0 or phentsize < struct.calcsize(program):
        raise Untrusted(f"{path} has no program headers")
    if phoff + phnum * phentsize > size:
        raise Untrusted(f"{path} is cut short (its program headers end past the file)")
    if shoff and shoff + shnum * shentsize > size:
        raise Untrusted(f"{path} is cut short (its section table ends past the file)")
    table = _read(fd, phoff, phnum * phentsize)
    dynamic = False
    for k in range(phnum):
        fields = struct.unpack_from(program, table, k * phentsize)
        if wide:
            p_type, _, p_offset, _, _, p_filesz = fields[:6]
        else:
            p_type, p_offset, _, _, p_filesz = fields[:5]
        dynamic |= p_type == _PT_DYNAMIC
        if p_type == _PT_LOAD and p_offset + p_filesz > size:
            raise Untrusted(f"{path} is cut short (a segment ends past the file)")
    if not dynamic:
        raise Untrusted(f"{path} is not a shared library (no dynamic section)")
