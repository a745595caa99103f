"""Registers the NumPy backend with mixprec (entry point ``numpy`` in the ``mixprec`` group).

mixprec imports this module to list backends, so it imports no NumPy: everything that
does lives in :mod:`mixprec_numpy`, which mixprec imports on first use.
"""

from __future__ import annotations

from mixprec.kit import BackendInfo, NativeDtypes, hookimpl, load_backend

__all__ = ["mixprec_native_dtypes", "mixprec_register_backends"]


@hookimpl
def mixprec_register_backends() -> list[BackendInfo]:
    """The ``numpy`` backend: ``mixprec_numpy.Trainer`` for the bundled MLP."""
    return [
        BackendInfo(
            name="numpy",
            framework="numpy",
            api_module="mixprec_numpy",
            description="NumPy reference backend: MLP with hand-written backward (plugin example)",
        )
    ]


@hookimpl
def mixprec_native_dtypes(backend: str, device: str, compute: str) -> NativeDtypes | None:
    """NumPy's own type rules for the families this backend implements, for the precision
    lockfile (see :mod:`mixprec_numpy.native`)."""
    if backend != "numpy":
        return None
    answer: NativeDtypes = load_backend("numpy").native_dtypes(device, compute)
    return answer
