"""Lazy package faces (PEP 562), shared by mixprec and its backends.

A backend's package is imported just to reach its plugin module, and that must not import
the framework. So packages list their public names with the module defining each, and
:func:`lazy_exports` builds the module ``__getattr__``/``__dir__`` that import a name on
first access and cache it in the package. :func:`backend_facades` makes ``mixprec.<backend>``
importable for any registered backend (:mod:`mixprec.engine.facades`).

These are the core's deliberate lazy imports: they name modules as strings, imported on
first use, so this module sits on the lowest floor and imports no other mixprec module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from types import ModuleType
from typing import Any

__all__ = ["backend_facades", "lazy_exports"]


def lazy_exports(
    package: str,
    names: Mapping[str, str],
    submodules: Collection[str] = (),
    *,
    facades: bool = False,
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``names`` maps each public name to the
    module that defines it; ``submodules`` are names that are modules of ``package`` itself.

    Use it as ``__getattr__, __dir__ = lazy_exports(__name__, {"wrap": "pkg.wrapping"})``.
    A cached name is set on the package, so a submodule that shares a function's name (and
    replaces it on import) is shadowed again by the function on first access. With
    ``facades=True`` any other public name is tried as a submodule, which is how
    ``package.<backend>`` reaches the facade finder of :func:`backend_facades`.
    """
    module = sys.modules[package]

    def __getattr__(name: str) -> Any:
        if name in submodules:
            return importlib.import_module(f"{package}.{name}")
        target = names.get(name)
        if target is not None:
            value = getattr(importlib.import_module(target), name)
            setattr(module, name, value)
            return value
        if facades and name.isidentifier() and not name.startswith("_"):
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as err:
                if err.name != f"{package}.{name}":
                    raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        # with an __all__, the public face: its names, its submodules, the dunders (not the
        # names the package imports for itself: lazy_exports, TYPE_CHECKING, annotations)
        public = getattr(module, "__all__", None)
        if public is None:
            return sorted(set(vars(module)) | set(names) | set(submodules))
        own = {
            name
            for name, value in vars(module).items()
            if name.startswith("__")
            or (isinstance(value, ModuleType) and value.__name__ == f"{package}.{name}")
        }
        return sorted(own | set(public) | set(submodules))

    return __getattr__, __dir__


class _FacadeFinder(importlib.abc.MetaPathFinder):
    """Finds ``<package>.<name>`` modules that have no file by asking ``provider``."""

    def __init__(self, package: str, provider: str) -> None:
        self.package = package
        self.provider = provider

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.rpartition(".")[0] != self.package:
            return None
        spec: importlib.machinery.ModuleSpec | None
        spec = importlib.import_module(self.provider).find_spec(fullname)
        return spec


def backend_facades(package: str, provider: str) -> None:
    """Make ``<package>.<name>`` importable when ``provider.find_spec`` answers for it.

    The finder goes last on ``sys.meta_path``, so real submodules are always found first
    and the provider (which loads the plugins) is imported only for names with no file.
    Installing twice for the same package does nothing.
    """
    for finder in sys.meta_path:
        if isinstance(finder, _FacadeFinder) and finder.package == package:
            return
    sys.meta_path.append(_FacadeFinder(package, provider))
