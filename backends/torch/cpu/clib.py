"""mixprec's CPU kernels (``_cpu_kernels.c``): compiled on first use, loaded with :mod:`ctypes`.

Three hot paths of a step have no single torch operation on the CPU:

- the step guard's pass over the gradients (:func:`guard_pass`): unscale, the inf/NaN check
  and the squared norm in one read of every gradient, one call for all of them (torch needs a
  norm kernel per tensor: a model of 300 small tensors paid more for it than GradScaler's whole
  unscale);
- the fused update of compensated bfloat16 weights (:func:`update`, used by
  :mod:`mixprec_torch.compensated.fused_update`): one pass per tensor over weight, compensation,
  gradient and optimizer state;
- stochastic rounding with counter-based noise (:func:`round_stochastic`, :func:`noise`).

**Building.** The first call compiles ``_cpu_kernels.c`` (plain C and pthreads, no Python or torch
headers: about a second) with the C compiler named by ``$CC`` or found as ``cc``, ``gcc`` or
``clang``, for this CPU (``-march=native``), into ``$MIXPREC_CACHE_DIR`` or
``$XDG_CACHE_HOME/mixprec`` (``~/.cache/mixprec``), named by a hash of the source, the
compiler, its flags and the CPU, so a cache shared between machines never loads another CPU's
build. The file is written to a temporary name and renamed (several processes may build at
once). ``MIXPREC_NATIVE=0`` switches the kernels off.

**Without a compiler** (or when the build fails, or with ``MIXPREC_NATIVE=0``) every caller
falls back to torch operations that give the same bits (tests/torch/test_cpu_kernels.py checks the
two against each other); only the speed differs. :func:`status` says which is in use and why.
"""

from __future__ import annotations

import array
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

__all__ = [
    "DTYPE_CODES",
    "Hyper",
    "Items",
    "guard_pass",
    "library",
    "noise",
    "round_stochastic",
    "status",
    "update",
]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("_cpu_kernels.c")
_ABI = 3
#: torch dtype -> the kernels' dtype code
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_FLAGS = ["-O2", "-ftree-vectorize", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared"]


def _flag_sets() -> tuple[list[str], ...]:
    """The compiler flags to try, the first that compiles wins; every set keeps
    ``-ffp-contract=off`` (bit-exactness). ``$MIXPREC_NATIVE_MARCH`` replaces ``native``
    as the target (e.g. ``x86-64-v3`` for a cache shared by different CPUs, or to run under
    valgrind, which has no AVX-512)."""
    march = os.environ.get("MIXPREC_NATIVE_MARCH", "native").strip() or "native"
    return ([*_FLAGS, f"-march={march}", "-pthread"], [*_FLAGS, "-pthread"])


_lock = threading.Lock()
_state: dict[str, object] = {}


_ITEM_FIELDS: tuple[str, ...] = (
    "w",
    "c",
    "g",
    "s0",
    "s1",
    "starts",
    "index",
    "step_size",
    "inv_bc2",
)
_ITEM_FIELDS += ("wmode", "gdt", "sdt", "first")


class Items(ctypes.Structure):
    """``mp_items``: the tensors of one fused update, as parallel arrays (addresses)."""

    _fields_ = [(name, ctypes.c_void_p) for name in _ITEM_FIELDS]


class Hyper(ctypes.Structure):
    """``mp_hyper``: the update rule and its scalars (float32, as the kernel uses them)."""

    _fields_ = [
        ("algo", ctypes.c_int32),
        ("maximize", ctypes.c_int32),
        ("decoupled", ctypes.c_int32),
        ("nesterov", ctypes.c_int32),
        ("lr", ctypes.c_float),
        ("weight_decay", ctypes.c_float),
        ("decay_mul", ctypes.c_float),
        ("beta1", ctypes.c_float),
        ("omb1", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("omb2", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("momentum", ctypes.c_float),
        ("omd", ctypes.c_float),
        ("key_w", ctypes.c_uint64),
        ("key_s0", ctypes.c_uint64),
        ("key_s1", ctypes.c_uint64),
    ]


def _cache_dir() -> Path:
    explicit = os.environ.get("MIXPREC_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mixprec"


def _compiler() -> str | None:
    named = os.environ.get("CC")
    if named:
        return shutil.which(named) or (named if os.path.isfile(named) else None)
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _cpu_identity() -> str:
    """What ``-march=native`` depends on: the CPU's feature flags where Linux lists them."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler_version(cc: str) -> str:
    try:
        out = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.splitlines()[0] if out.stdout else ""


def _build(cc: str) -> tuple[Path | None, str]:
    """Compile the source into the cache (or find it there); (path, why not)."""
    source = _SOURCE.read_bytes()
    version = _compiler_version(cc)
    folder = _cache_dir()
    errors = []
    for flags in _flag_sets():
        key = hashlib.sha256(
            b"\0".join(
                [
                    source,
                    cc.encode(),
                    version.encode(),
                    " ".join(flags).encode(),
                    _cpu_identity().encode(),
                    platform.machine().encode(),
                ]
            )
        ).hexdigest()[:24]
        target = folder / f"mixprec-native-{key}.so"
        if target.exists():
            return target, ""
        try:
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=folder)
            os.close(fd)
        except OSError as exc:
            return None, f"cannot write the kernel cache {folder}: {exc}"
        try:
            done = subprocess.run(
                [cc, *flags, "-o", tmp, str(_SOURCE)],
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            if done.returncode == 0:
                os.replace(tmp, target)
                return target, ""
            errors.append(f"{' '.join(flags)}: {done.stderr.strip()[-400:]}")
        except (OSError, subprocess.SubprocessError) as exc:
            errors.append(f"{' '.join(flags)}: {exc}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return None, f"{cc} could not compile {_SOURCE.name}: " + "; ".join(errors)


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    if lib.mp_abi_version() != _ABI:
        raise OSError(f"{path} is not built from this mixprec's {_SOURCE.name}")
    p, i64, i32, f32, u64 = (
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int32,
        ctypes.c_float,
        ctypes.c_uint64,
    )
    lib.mp_guard.argtypes = [i64, p, p, p, p, p, f32, i32, i32]
    lib.mp_guard.restype = ctypes.c_double
    lib.mp_update.argtypes = [i64, ctypes.POINTER(Items), ctypes.POINTER(Hyper), i32]
    lib.mp_update.restype = None
    lib.mp_round_sr.argtypes = [p, i64, u64, i64, i32]
    lib.mp_round_sr.restype = None
    lib.mp_noise.argtypes = [p, i64, u64, i64]
    lib.mp_noise.restype = None
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernels, building them on the first call; None where they cannot be had."""
    if "lib" in _state:
        return _state["lib"]  # type: ignore[return-value]
    with _lock:
        if "lib" in _state:
            return _state["lib"]  # type: ignore[return-value]
        lib: ctypes.CDLL | None = None
        reason = ""
        if os.environ.get("MIXPREC_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
            reason = "switched off by MIXPREC_NATIVE=0"
        elif not sys.platform.startswith(("linux", "darwin", "freebsd")):
            reason = f"not built on {sys.platform}"
        else:
            cc = _compiler()
            if cc is None:
                reason = "no C compiler found ($CC, cc, gcc, clang)"
            else:
                path, reason = _build(cc)
                if path is not None:
                    try:
                        lib = _load(path)
                    except OSError as exc:
                        reason = f"cannot load {path}: {exc}"
        if lib is None:
            logger.info("mixprec native kernels unavailable (%s): using torch operations", reason)
        _state["lib"] = lib
        _state["reason"] = reason
        return lib


def status() -> str:
    """Whether the kernels are in use, and if not, why."""
    lib = library()
    return "in use" if lib is not None else f"not in use: {_state.get('reason')}"


def _threads() -> int:
    return max(1, torch.get_num_threads())


def _address(values: array.array) -> int:  # type: ignore[type-arg]
    return values.buffer_info()[0] if len(values) else 0


def guard_pass(
    lib: ctypes.CDLL,
    sources: array.array,  # type: ignore[type-arg]
    targets: array.array,  # type: ignore[type-arg]
    starts: array.array,  # type: ignore[type-arg]
    sdt: array.array,  # type: ignore[type-arg]
    ddt: array.array,  # type: ignore[type-arg]
    inv_scale: float | None,
) -> float:
    """The sum of squares of the source tensors (contiguous CPU float32/bfloat16/float16
    tensors, by address), each multiplied by ``inv_scale`` first when given and written to
    its target (a float32 or bfloat16 tensor of its size, possibly itself) where there is
    one.

    :param sources: the sources' data addresses (uint64).
    :param targets: the targets' data addresses (uint64; 0: no target).
    :param starts: the running element counts (``len(sources) + 1`` int64 values).
    :param sdt: the sources' dtype codes (:data:`DTYPE_CODES`, int32).
    :param ddt: the targets' dtype codes (int32; any value where there is no target).
    """
    scaled = inv_scale is not None
    return float(
        lib.mp_guard(
            len(sources),
            _address(sources),
            _address(targets),
            _address(sdt),
            _address(ddt),
            _address(starts),
            inv_scale if scaled else 1.0,
            int(scaled),
            _threads(),
        )
    )


def update(lib: ctypes.CDLL, count: int, items: Items, hyper: Hyper) -> None:
    """One fused update over ``count`` tensors (see ``mp_update`` in ``_cpu_kernels.c``)."""
    lib.mp_update(count, ctypes.byref(items), ctypes.byref(hyper), _threads())


def round_stochastic(lib: ctypes.CDLL, work: torch.Tensor, key: int, index: int) -> None:
    """Round the contiguous float32 ``work`` stochastically onto the bfloat16 grid, in place,
    with the noise of elements ``index ..`` under ``key``."""
    lib.mp_round_sr(work.data_ptr(), work.numel(), key, index, _threads())


def noise(lib: ctypes.CDLL, key: int, index: int, count: int) -> torch.Tensor:
    """The 16-bit noise of elements ``index .. index + count - 1`` under ``key`` (int32)."""
    out = torch.empty(count, dtype=torch.int16)
    lib.mp_noise(out.data_ptr(), count, key, index)
    return out.to(torch.int32).bitwise_and_(0xFFFF)
