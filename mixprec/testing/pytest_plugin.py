"""pytest plugin: runs mixprec's conformance suite on the backends a conftest names.

In the backend's top-level ``conftest.py``::

    pytest_plugins = ["mixprec.testing.pytest_plugin"]
    mixprec_backends = ["numpy"]

Next to every ``conftest.py`` that defines ``mixprec_backends``, the suite
(:mod:`mixprec.testing.suite`) is collected as ``<dir>/mixprec_conformance.py``, with each
test parametrised over those backends. ``--mixprec-backend=NAME`` (repeatable, or
comma-separated) replaces the list for the run. A named backend that cannot be built fails
``test_backend_builds[NAME]``; it is never skipped. Entries of the backend's
``conformance_xfail.txt`` become strict xfails.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from mixprec.testing.cases import BackendUnderTest, build_backend, no_cases

pytest.register_assert_rewrite("mixprec.testing.suite")

SUITE_NAME = "mixprec_conformance.py"
"""The file name the suite is collected under (there is no such file on disk)."""

_backends_key = pytest.StashKey[dict[str, BackendUnderTest]]()
_collected_key = pytest.StashKey[bool]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mixprec", "mixprec conformance suite")
    group.addoption(
        "--mixprec-backend",
        action="append",
        default=[],
        metavar="NAME",
        help="run the mixprec conformance suite on backend NAME (repeatable or "
        "comma-separated); replaces mixprec_backends from conftest.py",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "mixprec_no_cases: a conformance test with no case for these backends"
    )


class ConformanceModule(pytest.Module):
    """The suite, collected in the directory of a conftest that sets ``mixprec_backends``."""

    backends: tuple[str, ...] = ()

    def _getobj(self) -> ModuleType:
        # the suite is an installed module, not a file under the tests
        return importlib.import_module("mixprec.testing.suite")


def _requested(config: pytest.Config, conftest: ModuleType) -> tuple[str, ...]:
    option: list[str] = config.getoption("mixprec_backend")
    names = [n.strip() for v in option for n in v.split(",")] if option else None
    if names is None:
        declared = conftest.mixprec_backends
        names = [declared] if isinstance(declared, str) else list(declared)
    names = list(dict.fromkeys(n for n in names if n))
    if not names:
        raise pytest.UsageError(
            f"{conftest.__file__} asks for the mixprec conformance suite but names no backend: "
            "set mixprec_backends = ['NAME'] there or pass --mixprec-backend=NAME"
        )
    return tuple(names)


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    if file_path.name != "conftest.py":
        return None
    conftest = parent.config.pluginmanager.get_plugin(str(file_path))
    if not isinstance(conftest, ModuleType) or not hasattr(conftest, "mixprec_backends"):
        return None
    module = ConformanceModule.from_parent(parent, path=file_path.with_name(SUITE_NAME))
    module.backends = _requested(parent.config, conftest)
    parent.config.stash[_collected_key] = True
    return module


def _backend(config: pytest.Config, name: str) -> BackendUnderTest:
    built = config.stash.setdefault(_backends_key, {})
    if name not in built:
        built[name] = build_backend(name)
    return built[name]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    module = metafunc.definition.getparent(ConformanceModule)
    if module is None:
        return
    test_name = metafunc.function.__name__
    argnames, generate = getattr(metafunc.function, "mixprec_cases", ((), no_cases))
    params: list[Any] = []
    for name in module.backends:
        backend = _backend(metafunc.config, name)
        if backend.error is not None and test_name != "test_backend_builds":
            continue  # test_backend_builds[name] fails with the reason
        for case_id, values in generate(backend):
            test_id = f"{test_name}[{case_id}]" if case_id else test_name
            backend.test_ids.add(test_id)
            reason = backend.xfail_reason(test_id)
            marks = []
            if reason is not None:
                where = backend.xfail_file.name if backend.xfail_file else "xfail file"
                marks.append(pytest.mark.xfail(strict=True, reason=f"{where}: {reason}"))
            params.append(
                pytest.param(
                    backend, *values, id=f"{name}-{case_id}" if case_id else name, marks=marks
                )
            )
    if not params:  # e.g. no unlisted dtype: dropped below rather than shown as a skip
        placeholder = (None,) * (1 + len(argnames))
        params.append(pytest.param(*placeholder, marks=pytest.mark.mixprec_no_cases))
    metafunc.parametrize(("backend", *argnames), params)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    empty = [item for item in items if item.get_closest_marker("mixprec_no_cases")]
    if empty:
        items[:] = [item for item in items if item not in empty]
        config.hook.pytest_deselected(items=empty)
    if config.getoption("mixprec_backend") and not config.stash.get(_collected_key, False):
        raise pytest.UsageError(
            "--mixprec-backend was given but no conftest.py among the collected tests sets "
            "mixprec_backends; add `mixprec_backends = []` to the conftest.py of the "
            "directory the conformance suite should run in"
        )
