"""Registers the Gluon backend with mixprec (entry point ``mxnet`` in the ``mixprec`` group).

This module must stay importable without MXNet: mixprec imports it to list backends, and
imports :mod:`mixprec_mxnet` (which imports MXNet) only when the backend is first used.
"""

from __future__ import annotations

from mixprec.kit import BackendInfo, NativeDtypes, hookimpl, load_backend

__all__ = ["mixprec_native_dtypes", "mixprec_register_backends"]


@hookimpl
def mixprec_register_backends() -> list[BackendInfo]:
    """The ``mxnet`` backend: ``mixprec.mxnet.Trainer`` for Gluon."""
    return [
        BackendInfo(
            name="mxnet",
            framework="mxnet",
            api_module="mixprec_mxnet",
            extra="mxnet",
            description="MXNet Gluon: mixprec.mxnet.Trainer (O1 graph casting, O2 fp32 masters)",
        )
    ]


@hookimpl
def mixprec_native_dtypes(backend: str, device: str, compute: str) -> NativeDtypes | None:
    """Where ``mxnet.contrib.amp``'s own lists put each op, for the precision lockfile (see
    :mod:`mixprec_mxnet.o1.framework_amp`)."""
    if backend != "mxnet":
        return None
    answer: NativeDtypes = load_backend("mxnet").native_dtypes(device, compute)
    return answer
