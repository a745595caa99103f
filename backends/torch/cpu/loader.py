"""Finding, checking and loading the kernel library; what to tell the user when the torch
twin runs instead.

Where the library comes from, in order:

1. ``MIXPREC_NATIVE=0`` (``false``, ``no``, ``off``): nowhere; the twin runs, nothing said.
2. ``MIXPREC_NATIVE_BUILD=1``: the developer build (:mod:`.devbuild`), compiled at first use
   into a private cache.
3. Otherwise the installed library, ``_mixprec_kernels.so`` beside this module, built with the
   package (the wheel carries it; ``pip install -e .`` builds it in place). Nothing else is
   ever compiled or looked for.

What the loader trusts (docs/reliability.md): the installed library is part of the install,
as the package's Python files are, and is loaded when neither it nor its folder is writable
by group or world; the developer cache only when the folder and the file are this user's
and writable by nobody else. Either is checked on an open descriptor *before* ``dlopen``
(:func:`~.libfile.open_library`: no link, a whole shared library for this machine) and loaded
through that descriptor. After loading, every symbol the Python calls must be there, the
ABI number must be the source's and the library must be built from the ``_cpu_kernels.c``
beside it (not a stale build after an edit).

When the library is missing or refused, the callers run the torch twin (the same bits, 15-20
times slower) and :func:`warn_once` says why, once per process, with a
:class:`NativeKernelsWarning` naming how to get the kernels.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from mixprec.errors import MixprecWarning

from . import devbuild
from .libfile import (
    LIBRARY,
    SYMBOLS,
    SourceFacts,
    Untrusted,
    check_folder,
    load_path,
    open_library,
    source_facts,
)

__all__ = ["HOW_TO", "KernelInfo", "NativeKernelsWarning", "load", "warn_once"]

_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")

HOW_TO = (
    "a mixprec wheel ships them; installing from source builds them with a C compiler "
    "(pip install ., or `make install` in a clone); MIXPREC_NATIVE_BUILD=1 builds them at "
    "first use (developers); MIXPREC_NATIVE=0 runs the torch twin without this warning"
)


class NativeKernelsWarning(MixprecWarning):
    """mixprec's CPU kernels are not in use (the torch twin runs: the same bits, slower), or
    were built somewhere else than asked; the message says why and how to get them."""


@dataclass(frozen=True)
class KernelInfo:
    """Where the kernels in use come from, or why none are."""

    origin: str
    """``installed``, ``built`` (the developer build), ``disabled`` (``MIXPREC_NATIVE=0``) or
    ``unavailable``."""
    path: str = ""
    isa: str = ""
    """The clone of the hot loops this CPU runs (``avx512f``, ``avx2``, ``default``)."""
    clones: str = ""
    """The ISAs the library carries clones for (``avx512f,avx2,default``)."""
    reason: str = ""
    """Why none are in use; for a library in use, anything the user should know."""

    @property
    def in_use(self) -> bool:
        return self.origin in ("installed", "built")

    def describe(self) -> str:
        """One line: ``in use: installed (<path>; avx2 of avx512f,avx2,default)`` or
        ``not in use: <why>``."""
        if not self.in_use:
            return f"not in use: {self.reason}"
        isa = f"{self.isa} of {self.clones}" if self.clones else self.isa
        line = f"in use: {self.origin} ({self.path}; {isa})"
        return f"{line}; {self.reason}" if self.reason else line


def _flag(name: str, values: tuple[str, ...]) -> bool:
    return os.environ.get(name, "").strip().lower() in values


def _installed() -> Path:
    return Path(os.path.realpath(Path(__file__).parent)) / LIBRARY


def _open(fd: int, path: Path, facts: SourceFacts) -> tuple[ctypes.CDLL, str, str]:
    """``dlopen`` the checked descriptor and check what the library says about itself;
    (library, isa, clones).

    :raises Untrusted: it cannot be loaded, lacks a symbol, or is another ABI or source.
    """
    try:
        lib = ctypes.CDLL(load_path(fd, path))
    except OSError as exc:
        raise Untrusted(f"cannot load {path}: {exc}") from None
    missing = [name for name in SYMBOLS if not hasattr(lib, name)]
    if missing:
        raise Untrusted(f"{path} is stale: it lacks {', '.join(missing)}")
    lib.mp_source_id.restype = ctypes.c_char_p
    lib.mp_isa.restype = ctypes.c_char_p
    lib.mp_isa_clones.restype = ctypes.c_char_p
    abi = lib.mp_abi_version()
    if abi != facts.abi:
        raise Untrusted(f"{path} has ABI {abi}, this mixprec's source {facts.abi}")
    built_from = lib.mp_source_id().decode(errors="replace")
    if built_from != facts.source_id:
        raise Untrusted(
            f"{path} is stale: built from another _cpu_kernels.c ({built_from}, the source "
            f"here is {facts.source_id})"
        )
    _declare(lib)
    return lib, lib.mp_isa().decode(), lib.mp_isa_clones().decode()


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32, f32, u64 = (
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int32,
        ctypes.c_float,
        ctypes.c_uint64,
    )
    lib.mp_guard.argtypes = [i64, p, p, p, p, p, f32, i32, i32]
    lib.mp_guard.restype = ctypes.c_double
    lib.mp_update.argtypes = [i64, p, p, i32]
    lib.mp_update.restype = None
    lib.mp_round_sr.argtypes = [p, i64, u64, i64, i32]
    lib.mp_round_sr.restype = None
    lib.mp_noise.argtypes = [p, i64, u64, i64]
    lib.mp_noise.restype = None
    lib.mp_lowbit_index.argtypes = [p, i32, p, i64]
    lib.mp_lowbit_index.restype = i64
    lib.mp_lowbit_quantize.argtypes = [p, i64, i64, p, p, p, i32]
    lib.mp_lowbit_quantize.restype = i64
    lib.mp_lowbit_dequantize.argtypes = [p, p, i64, i64, p, p, i32]
    lib.mp_lowbit_dequantize.restype = None
    lib.mp_lowbit_update.argtypes = [i64, p, p, p, p, i64, i32]
    lib.mp_lowbit_update.restype = i64
    lib.mp_maxabs.argtypes = [i64, p, p, p, i32]
    lib.mp_maxabs.restype = f32


#: The descriptors of the libraries loaded through ``/proc/self/fd``, kept open (close on
#: exec) so that the name the process knows them by stays valid for debuggers, profilers
#: and the sanitizers' symbolizer.
_held: list[int] = []


def _from_fd(
    fd: int, path: Path, facts: SourceFacts, origin: str, notes: str
) -> tuple[ctypes.CDLL, KernelInfo]:
    try:
        lib, isa, clones = _open(fd, path, facts)
    except BaseException:
        os.close(fd)
        raise
    _held.append(fd)
    return lib, KernelInfo(origin, str(path), isa, clones, notes)


def load() -> tuple[ctypes.CDLL | None, KernelInfo]:
    """Find, check and load the kernels (see the module docstring); never raises.

    Call it once per process (``mixprec_torch.cpu.clib.library`` caches it) and pass the
    info to :func:`warn_once`.
    """
    if _flag("MIXPREC_NATIVE", _OFF):
        return None, KernelInfo("disabled", reason="switched off by MIXPREC_NATIVE=0")
    if not sys.platform.startswith(("linux", "darwin", "freebsd")):
        return None, KernelInfo("unavailable", reason=f"not built on {sys.platform}")
    try:
        facts = source_facts()
    except (OSError, ValueError) as exc:
        return None, KernelInfo("unavailable", reason=f"cannot read the kernels' source: {exc}")
    if _flag("MIXPREC_NATIVE_BUILD", _ON):
        try:
            built = devbuild.build(facts)
        except devbuild.BuildFailed as exc:
            return None, KernelInfo("unavailable", reason=f"the developer build failed: {exc}")
        try:
            return _from_fd(built.fd, built.path, facts, "built", "; ".join(built.notes))
        except Untrusted as exc:
            return None, KernelInfo("unavailable", reason=f"the developer build: {exc}")
    path = _installed()
    if not os.path.lexists(path):
        return None, KernelInfo(
            "unavailable", reason=f"this install has no compiled library ({path} is missing)"
        )
    try:
        check_folder(path.parent, own=False)
        fd = open_library(path, own=False)
        return _from_fd(fd, path, facts, "installed", "")
    except Untrusted as exc:
        return None, KernelInfo("unavailable", reason=f"the installed library is refused: {exc}")


_warned = False


def warn_once(info: KernelInfo, stacklevel: int = 3) -> None:
    """Say once per process that the twin runs and why (not when ``MIXPREC_NATIVE=0`` asked
    for it), or what the developer build did that the user should know."""
    global _warned
    if _warned or info.origin == "disabled" or (info.in_use and not info.reason):
        return
    _warned = True
    if info.in_use:
        message = f"mixprec's CPU kernels: {info.reason}"
    else:
        message = (
            f"mixprec's CPU kernels are not in use ({info.reason}): the torch twin runs instead "
            f"(the same bits, 15-20x slower for these passes). To get them: {HOW_TO}."
        )
    warnings.warn(message, NativeKernelsWarning, stacklevel=stacklevel)
