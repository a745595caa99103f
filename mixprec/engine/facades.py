"""``mixprec.<backend>``: one generic facade module for every registered backend.

``mixprec.torch.wrap`` is ``mixprec_torch.wrap``, ``mixprec.numpy.Trainer`` is
``mixprec_numpy.Trainer``: the same mechanism serves the built-in backends and any plugin.
``import mixprec.torch as mp``, ``from mixprec import torch`` and ``mixprec.mxnet`` all reach
:func:`find_spec` through the finder :func:`mixprec.lazy.backend_facades` installs, which
answers for a name only when a plugin declares that backend. The facade imports the
backend's api module on first attribute access (:func:`mixprec.engine.plugins.load_backend`), so
``import mixprec.torch`` never imports torch, and with torch missing any attribute raises
:class:`~mixprec.errors.BackendNotAvailable` naming the pip extra to install.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
from types import ModuleType
from typing import Any

from mixprec.engine.plugins import KNOWN_PLUGINS, list_backends, load_backend

__all__ = ["BackendFacade", "find_spec", "public_names"]

PACKAGE = "mixprec"


def public_names(module: ModuleType) -> list[str]:
    """The public names of a backend's api module: its ``__all__``; without one, the names
    its ``dir()`` lists that are neither private, nor modules, nor ``typing`` helpers."""
    names = getattr(module, "__all__", None)
    if names is not None:
        return sorted(str(name) for name in names)
    return sorted(
        name
        for name in dir(module)
        if not name.startswith("_")
        and name not in ("TYPE_CHECKING", "annotations")
        and not isinstance(vars(module).get(name), ModuleType)
    )


class BackendFacade(ModuleType):
    """The module ``mixprec.<backend>``: attribute access goes to the backend's api module.

    ``__all__`` and ``dir()`` are the backend's public names (:func:`public_names`), so
    ``from mixprec.torch import *`` and tab completion see ``wrap``, ``scale_loss``... and
    not the api module's own plumbing (``lazy_exports``, ``plugin``, ``TYPE_CHECKING``).
    """

    def __init__(self, name: str, backend: str) -> None:
        super().__init__(name, f"Facade for the {backend} backend: see mixprec.engine.facades.")
        self.BACKEND = backend

    def __getattr__(self, name: str) -> Any:
        if name == "__all__":  # `from mixprec.torch import *`, computed once the backend loads
            return public_names(load_backend(self.BACKEND))
        if name.startswith("__"):  # module protocol probes (__path__, __wrapped__, ...)
            raise AttributeError(name)
        return getattr(load_backend(self.BACKEND), name)

    def __dir__(self) -> list[str]:
        own = {name for name in vars(self) if name.startswith("__")}
        return sorted(own | {"BACKEND", "__all__"} | set(public_names(load_backend(self.BACKEND))))


class _FacadeLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return BackendFacade(spec.name, spec.name.rpartition(".")[2])

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the facade resolves every name on access."""


_LOADER = _FacadeLoader()


def find_spec(fullname: str) -> importlib.machinery.ModuleSpec | None:
    """The spec of facade ``fullname`` (``"mixprec.<backend>"``), or None when no plugin
    declares that backend (then the import fails as for any missing module). A backend of
    :data:`~mixprec.engine.plugins.KNOWN_PLUGINS` gets a facade even when its plugin is missing:
    its attributes then raise :class:`~mixprec.errors.BackendNotAvailable` naming the extra
    that installs it."""
    package, _, backend = fullname.rpartition(".")
    if package != PACKAGE or not backend.isidentifier() or backend.startswith("_"):
        return None
    if backend not in KNOWN_PLUGINS and backend not in {row.info.name for row in list_backends()}:
        return None
    return importlib.machinery.ModuleSpec(fullname, _LOADER, origin=f"backend {backend!r}")
