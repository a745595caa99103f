"""What ``torch.autocast`` itself does with each op: the torch answer to the lockfile's hook.

:func:`native_dtypes` runs one representative call per neutral family (the first probe of
:data:`mixprec_torch.o1.probes.PROBES`) and a few native ops outside mixprec's vocabulary
(:data:`NATIVE_OPS`: autocast decides those under an op-casting policy) inside
``torch.autocast``, with every floating input in one dtype, and reports the dtype of each
result. The lockfile (:mod:`mixprec.lock`) records the answers, so an upgrade of torch that
moves an op between autocast's lists is named by ``mixprec lock --check``.

CUDA needs no GPU: the calls run on fake CUDA tensors
(``torch._subclasses.fake_tensor.FakeTensorMode``) with CUDA autocast switched on by hand
(``torch.set_autocast_enabled("cuda", True)``), which dispatches to torch's own
AutocastCUDA kernels; only shapes and dtypes are computed, never values.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from mixprec.errors import BackendNotAvailable
from mixprec.kit import NativeDtypes

from .. import torch_private
from ..dtypes import dtype_name, torch_dtype
from .probes import PROBES, result_dtype

__all__ = ["NATIVE_OPS", "native_dtypes"]

Call = Callable[[Sequence[torch.dtype], torch.device], Any]


def _x(dtype: torch.dtype, device: torch.device, *shape: int) -> torch.Tensor:
    return torch.ones(*shape, dtype=dtype, device=device)


#: Native ops outside the neutral vocabulary that autocast has lists for: under an
#: op-casting policy they pass mixprec by and run as autocast says (``torch:<name>`` in a
#: policy). ``rms_norm`` is why the lockfile exists: CUDA autocast moved it to float32.
NATIVE_OPS: dict[str, tuple[int, Call]] = {
    "torch:rms_norm": (2, lambda ds, d: F.rms_norm(_x(ds[0], d, 4, 8), (8,), _x(ds[1], d, 8))),
    "torch:softplus": (1, lambda ds, d: F.softplus(_x(ds[0], d, 4, 8))),
    "torch:rsqrt": (1, lambda ds, d: torch.rsqrt(_x(ds[0], d, 4, 8))),
    "torch:cosine_similarity": (
        2,
        lambda ds, d: F.cosine_similarity(_x(ds[0], d, 4, 8), _x(ds[1], d, 4, 8)),
    ),
    "torch:cdist": (2, lambda ds, d: torch.cdist(_x(ds[0], d, 4, 8), _x(ds[1], d, 3, 8))),
}


def _calls() -> dict[str, tuple[int, Call]]:
    calls = {family: probes[0] for family, probes in PROBES.items()}
    calls.update(NATIVE_OPS)
    return calls


@contextlib.contextmanager
def _autocast(device_type: str, dtype: torch.dtype | None) -> Iterator[torch.device]:
    """``torch.autocast(device_type, dtype)`` (None: autocast off) around calls on tensors of
    that device; CUDA runs on fake tensors, with its autocast state switched by hand
    (``torch.autocast("cuda")`` turns itself off without a GPU) and restored after."""
    if device_type == "cpu":
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            yield torch.device("cpu")
        return
    enabled, old = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    with torch.no_grad(), torch_private.fake_tensor_mode():
        torch.set_autocast_enabled("cuda", dtype is not None)
        if dtype is not None:
            torch.set_autocast_dtype("cuda", dtype)
        try:
            yield torch.device("cuda")
        finally:
            torch.set_autocast_enabled("cuda", enabled)
            torch.set_autocast_dtype("cuda", old)


def _run(device_type: str, autocast: torch.dtype | None, call: Call, inputs: Any) -> str:
    with _autocast(device_type, autocast) as device:
        return dtype_name(result_dtype(call(inputs, device)))


def _answer(
    device_type: str, lowp: torch.dtype, call: Call, inputs: Any
) -> tuple[bool, str | None]:
    """(whether the call runs here at all, the dtype it gives under autocast or None when
    autocast refuses it). A call that fails without autocast too hits a fake tensor's limit
    and has no answer."""
    try:
        return True, _run(device_type, lowp, call, inputs)
    except Exception:
        try:
            _run(device_type, None, call, inputs)
        except Exception:
            return False, None
        return True, None


@functools.cache
def _native(device_type: str, compute: str) -> dict[str, dict[str, str | None]]:
    lowp = torch_dtype(compute)
    out: dict[str, dict[str, str | None]] = {}
    for name, (n, call) in _calls().items():
        answers = {
            dtype_name(dtype): _answer(device_type, lowp, call, (dtype,) * n)
            for dtype in (torch.float32, lowp)
        }
        if all(ran for ran, _ in answers.values()):
            out[name] = {inputs: dtype for inputs, (_, dtype) in answers.items()}
    return out


def native_dtypes(device: str, compute: str) -> NativeDtypes:
    """What ``torch.autocast(device, dtype=compute)`` makes each op compute in, for float32
    inputs and for ``compute`` inputs (None: autocast refused them, as it refuses
    ``binary_cross_entropy``). An op whose call cannot run here even without autocast (a
    few do not run on fake CUDA tensors: ``torch.gru_cell``, ``F.batch_norm``) is left out.

    :param device: ``"cpu"`` or ``"cuda"`` (run on fake tensors: no GPU needed).
    :raises BackendNotAvailable: another device.
    """
    device_type = device.split(":")[0]
    if device_type not in ("cpu", "cuda"):
        raise BackendNotAvailable(
            f"the torch backend locks for 'cpu' or 'cuda', not {device!r}; pass --device cpu "
            "or --device cuda"
        )
    source = f"torch.autocast({device_type!r}, dtype=torch.{compute})"
    ops: Mapping[str, Mapping[str, str | None]] = _native(device_type, compute)
    return NativeDtypes(source=source, dtypes=ops)
