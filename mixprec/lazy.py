"""Lazy package exports (PEP 562), shared by mixprec and its backends.

A backend's package is imported just to reach its plugin module, and that must not import
the framework. So packages list their public names with the module defining each, and
:func:`lazy_exports` builds the module ``__getattr__``/``__dir__`` that import a name on
first access and cache it in the package.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Collection, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, names: Mapping[str, str], submodules: Collection[str] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``names`` maps each public name to the
    module that defines it; ``submodules`` are names that are modules of ``package`` itself.

    Use it as ``__getattr__, __dir__ = lazy_exports(__name__, {"wrap": "pkg.wrapping"})``.
    A cached name is set on the package, so a submodule that shares a function's name (and
    replaces it on import) is shadowed again by the function on first access.
    """
    module = sys.modules[package]

    def __getattr__(name: str) -> Any:
        if name in submodules:
            return importlib.import_module(f"{package}.{name}")
        target = names.get(name)
        if target is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(target), name)
        setattr(module, name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(module)) | set(names) | set(submodules))

    return __getattr__, __dir__
