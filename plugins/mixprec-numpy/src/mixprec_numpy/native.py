"""What NumPy itself computes each op in: the NumPy answer to the lockfile's hook.

This backend's layers ask the policy for every op's dtype, so nothing runs "natively" the
way ``torch.autocast`` does; the lock records NumPy's own type rules beside the policy's
answers all the same, for the families the backend implements (:data:`NATIVE_CALLS`: the
plain NumPy expression of each, without mixprec's casts). NumPy keeps float16 inputs in
float16; it has no bfloat16, so bfloat16 values live in float32 arrays (see
:mod:`mixprec_numpy.casting`) and NumPy computes on them in float32.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mixprec.errors import BackendNotAvailable
from mixprec.kit import NativeDtypes
from mixprec_numpy.casting import Array

__all__ = ["NATIVE_CALLS", "native_dtypes"]

_STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.float32}
_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}


def _softmax(x: Array) -> Array:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)  # type: ignore[no-any-return]


#: Each family the backend implements, as plain NumPy on an array ``x`` (a weight ``x.T``).
NATIVE_CALLS: dict[str, Callable[[Array], Array]] = {
    "linear": lambda x: x @ x.T,
    "relu": lambda x: np.maximum(x, 0),
    "softmax": _softmax,
    "cross_entropy": lambda x: -np.log(_softmax(x)[:, 0]).mean(),
}


def native_dtypes(device: str, compute: str) -> NativeDtypes:
    """The dtype NumPy computes each family in, for float32 and ``compute`` inputs.

    :raises BackendNotAvailable: a device other than ``"cpu"``.
    """
    if device != "cpu":
        raise BackendNotAvailable(f"the NumPy backend runs on 'cpu' only, not {device!r}")
    dtypes = {}
    for family, call in NATIVE_CALLS.items():
        answers: dict[str, str | None] = {}
        for inputs in ("float32", compute):
            x = np.linspace(-1.0, 1.0, 12).reshape(3, 4).astype(_STORAGE[inputs])
            answers[inputs] = _NAMES.get(np.asarray(call(x)).dtype)
        dtypes[family] = answers
    return NativeDtypes(source="NumPy's type rules (bfloat16 stored as float32)", dtypes=dtypes)
