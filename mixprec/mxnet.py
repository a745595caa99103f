"""Facade for the mxnet backend: ``mixprec.mxnet.<name>`` is ``mixprec_mxnet.<name>``.

The backend is looked up through the plugin registry and imported on first attribute
access, so ``import mixprec`` never imports mxnet. With mxnet missing, any attribute raises
:class:`~mixprec.errors.BackendNotAvailable` naming the pip extra to install.
"""

from __future__ import annotations

from typing import Any

from mixprec.backend import load_backend

BACKEND = "mxnet"


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(load_backend(BACKEND), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(dir(load_backend(BACKEND))))
