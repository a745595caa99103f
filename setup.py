"""Build mixprec's CPU kernels with the package; every other setting is in pyproject.toml.

``backends/torch/cpu/_cpu_kernels.c`` becomes ``mixprec_torch/cpu/_mixprec_kernels.so``: a
plain shared library (no Python headers, loaded with ctypes by ``mixprec_torch.cpu.loader``)
that the wheel carries, so installing the wheel needs no compiler. ``pip install -e .`` builds
it in place. The flags are the C file's own ``mixprec-cflags:`` line (never ``-march=native``:
the hot loops carry AVX-512, AVX2 and baseline clones and the CPU picks one at run time).
Where nothing can compile it (``optional``), the package installs without it and the torch
twin runs, with a warning saying how to get the kernels.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
CPU = HERE / "backends" / "torch" / "cpu"


def _libfile() -> ModuleType:
    """``mixprec_torch.cpu.libfile`` by its path: the package itself cannot be imported here
    (torch need not be installed to build)."""
    spec = importlib.util.spec_from_file_location("_mixprec_libfile", CPU / "libfile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class BuildKernels(build_ext):  # type: ignore[misc]
    """Name the library ``_mixprec_kernels.so``: it is no Python module, so no ABI tag."""

    def get_ext_filename(self, fullname: str) -> str:
        if fullname.split(".")[-1] == "_mixprec_kernels":
            return os.path.join(*fullname.split(".")) + ".so"
        return str(super().get_ext_filename(fullname))

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return list(ext.export_symbols)  # no PyInit_ function to export


def _extensions() -> list[Extension]:
    if os.name != "posix":  # the C uses pthreads; elsewhere the torch twin runs
        return []
    libfile = _libfile()
    facts = libfile.source_facts(CPU / "_cpu_kernels.c")
    compile_flags = [*facts.cflags, facts.define()]
    return [
        Extension(
            "mixprec_torch.cpu._mixprec_kernels",
            sources=["backends/torch/cpu/_cpu_kernels.c"],
            extra_compile_args=compile_flags,
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]


setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildKernels})
