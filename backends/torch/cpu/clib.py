"""mixprec's CPU kernels (``_cpu_kernels.c``), loaded with :mod:`ctypes`, and the calls into them.

Three hot paths of a step have no single torch operation on the CPU:

- the step guard's pass over the gradients (:func:`guard_pass`): unscale, the inf/NaN check
  and the squared norm in one read of every gradient, one call for all of them (torch needs a
  norm kernel per tensor: a model of 300 small tensors paid more for it than GradScaler's whole
  unscale);
- the fused update of compensated bfloat16 weights (:func:`update`, used by
  :mod:`mixprec_torch.compensated.fused_update`): one pass per tensor over weight, compensation,
  gradient and optimizer state;
- stochastic rounding with counter-based noise (:func:`round_stochastic`, :func:`noise`);
- the low-bit optimizer state's block-wise codec (:func:`lowbit_quantize`,
  :func:`lowbit_dequantize`: a binary search over 255 midpoints per element is no torch
  operation that runs fast) and its fused update (:func:`lowbit_update`, used by
  :mod:`mixprec_torch.lowbit.fused_step`): decode a block, update, encode it, one pass.

**Where the library comes from.** It is built with the package (``setup.py``: the wheel
carries it, ``pip install -e .`` builds it in place) with fixed flags, the ISA of its hot loops
picked at run time; :mod:`.loader` finds and checks it (:mod:`.libfile`: what it trusts), or
the developer build (:mod:`.devbuild`, ``MIXPREC_NATIVE_BUILD=1``) compiles it at first use
into a private cache. ``MIXPREC_NATIVE=0`` switches the kernels off.

**Without the library** every caller falls back to torch operations that give the same bits
(tests/torch/test_cpu_kernels.py checks the two against each other); only the speed differs,
and a :class:`~.loader.NativeKernelsWarning` says so once per process. Only CPU work asks for
the library (:func:`library`): a CUDA run never loads it. :func:`status` says which is in use
and why; ``mixprec backends`` prints it (:func:`backend_notes`).
"""

from __future__ import annotations

import array
import ctypes
import threading

import torch

from . import loader
from .loader import KernelInfo, NativeKernelsWarning

__all__ = [
    "DTYPE_CODES",
    "Hyper",
    "Items",
    "KernelInfo",
    "LowbitItems",
    "LowbitMap",
    "NativeKernelsWarning",
    "backend_notes",
    "guard_pass",
    "info",
    "library",
    "lowbit_dequantize",
    "lowbit_index",
    "lowbit_quantize",
    "lowbit_update",
    "max_abs",
    "noise",
    "round_stochastic",
    "status",
    "update",
]

#: torch dtype -> the kernels' dtype code
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_lock = threading.Lock()
#: The process's answer, once asked: ``lib`` (the library or None), ``reason`` (why none)
#: and ``info`` (:class:`~.loader.KernelInfo`). Tests and benchmarks swap it to run the twin.
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


class LowbitMap(ctypes.Structure):
    """``mp_map``: one low-bit map as the codec reads it (addresses of float32 tensors the
    caller keeps alive: the values padded to ``2**bits`` with NaN, the midpoints, and their
    index from :func:`lowbit_index`)."""

    _fields_ = [
        ("values", ctypes.c_void_p),
        ("mids", ctypes.c_void_p),
        ("index", ctypes.c_void_p),
        ("nmids", ctypes.c_int32),
        ("bits", ctypes.c_int32),
    ]


_LOWBIT_FIELDS: tuple[str, ...] = ("w", "g", "c0", "a0", "c1", "a1", "o0", "b0", "o1", "b1")
_LOWBIT_FIELDS += ("starts", "bstarts", "step_size", "inv_bc2", "gdt", "bad")


class LowbitItems(ctypes.Structure):
    """``mp_lowbit_items``: the tensors of one fused low-bit update, as parallel arrays."""

    _fields_ = [(name, ctypes.c_void_p) for name in _LOWBIT_FIELDS]


def _ask() -> KernelInfo:
    """Load once per process (:func:`~.loader.load`) into :data:`_state`."""
    with _lock:
        if "lib" not in _state:
            lib, answer = loader.load()
            if lib is not None:
                lib.mp_update.argtypes = [
                    ctypes.c_int64,
                    ctypes.POINTER(Items),
                    ctypes.POINTER(Hyper),
                    ctypes.c_int32,
                ]
            _state.update(lib=lib, reason=answer.reason, info=answer)
    known = _state.get("info")
    if isinstance(known, KernelInfo):
        return known
    # a test or benchmark set the state by hand
    origin = "installed" if _state.get("lib") is not None else "unavailable"
    return KernelInfo(origin, reason=str(_state.get("reason", "")))


def library() -> ctypes.CDLL | None:
    """The loaded kernels, None where they cannot be had (then, once per process, a
    :class:`~.loader.NativeKernelsWarning` says why). Call it only for CPU work."""
    if "lib" not in _state:
        loader.warn_once(_ask())
    return _state["lib"]  # type: ignore[return-value]


def info() -> KernelInfo:
    """Where the kernels come from, or why none are in use (loads them; warns nothing)."""
    return _ask()


def status() -> str:
    """Whether the kernels are in use and where from, and if not, why."""
    return info().describe()


def backend_notes() -> list[str]:
    """The lines ``mixprec backends`` prints under the torch backend."""
    return [f"CPU kernels: {status()}"]


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


def lowbit_index(lib: ctypes.CDLL, mids: torch.Tensor) -> torch.Tensor:
    """The search index of a map's contiguous float32 midpoints (int32, a few KB; see
    ``mp_lowbit_index``): what :class:`LowbitMap` points to."""
    words = lib.mp_lowbit_index(mids.data_ptr(), mids.numel(), None, 0)
    index = torch.empty(words, dtype=torch.int32)
    lib.mp_lowbit_index(mids.data_ptr(), mids.numel(), index.data_ptr(), words)
    return index


def _scratch_failed(result: int) -> int:
    if result < 0:
        raise MemoryError("mixprec's CPU kernels could not allocate their scratch memory")
    return result


def lowbit_quantize(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    block: int,
    table: LowbitMap,
    codes: torch.Tensor,
    absmax: torch.Tensor,
) -> int:
    """Encode the contiguous float32 ``x`` (flat order) into ``codes`` (uint8) and ``absmax``
    (float32, one per block); returns how many blocks have an absmax that is not finite."""
    return _scratch_failed(
        lib.mp_lowbit_quantize(
            x.data_ptr(),
            x.numel(),
            block,
            ctypes.addressof(table),
            codes.data_ptr(),
            absmax.data_ptr(),
            _threads(),
        )
    )


def lowbit_dequantize(
    lib: ctypes.CDLL,
    codes: torch.Tensor,
    absmax: torch.Tensor,
    block: int,
    table: LowbitMap,
    out: torch.Tensor,
) -> None:
    """Decode contiguous ``codes`` and ``absmax`` into the contiguous float32 ``out``."""
    lib.mp_lowbit_dequantize(
        codes.data_ptr(),
        absmax.data_ptr(),
        out.numel(),
        block,
        ctypes.addressof(table),
        out.data_ptr(),
        _threads(),
    )


def lowbit_update(
    lib: ctypes.CDLL,
    count: int,
    items: LowbitItems,
    hyper: Hyper,
    signed: LowbitMap,
    unsigned: LowbitMap,
    block: int,
) -> int:
    """One fused low-bit update over ``count`` tensors (see ``mp_lowbit_update``); returns
    how many blocks of new state are not finite (``items.bad`` says which tensors)."""
    return _scratch_failed(
        lib.mp_lowbit_update(
            count,
            ctypes.addressof(items),
            ctypes.addressof(hyper),
            ctypes.addressof(signed),
            ctypes.addressof(unsigned),
            block,
            _threads(),
        )
    )


def max_abs(lib: ctypes.CDLL, tensors: list[torch.Tensor]) -> float:
    """The largest magnitude over contiguous float32/bfloat16 CPU ``tensors`` (NaN where one
    holds a NaN, inf where one holds an infinity; 0 for none)."""
    starts = array.array("q", [0])
    for t in tensors:
        starts.append(starts[-1] + t.numel())
    sources = array.array("Q", [t.data_ptr() for t in tensors])
    dtypes = array.array("i", [DTYPE_CODES[t.dtype] for t in tensors])
    return float(
        lib.mp_maxabs(
            len(tensors), _address(sources), _address(dtypes), _address(starts), _threads()
        )
    )


def noise(lib: ctypes.CDLL, key: int, index: int, count: int) -> torch.Tensor:
    """The 16-bit noise of elements ``index .. index + count - 1`` under ``key`` (int32)."""
    out = torch.empty(count, dtype=torch.int16)
    lib.mp_noise(out.data_ptr(), count, key, index)
    return out.to(torch.int32).bitwise_and_(0xFFFF)
