"""Thread safety of the core's lazy globals: concurrent first calls race through a barrier.

The contract these tests hold is written in docs/architecture.md ("Threads").
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, TypeVar

import pytest

from mixprec.engine import plugins
from mixprec.policy.value import builtin_preset

T = TypeVar("T")
THREADS = 8


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    plugins.reset()
    yield
    plugins.reset()


def race(call: Callable[[], T]) -> list[T]:
    """``call`` from THREADS threads released together; every result, or the first error."""
    barrier = threading.Barrier(THREADS)
    results: list[Any] = [None] * THREADS
    errors: list[BaseException] = []

    def run(index: int) -> None:
        barrier.wait()
        try:
            results[index] = call()
        except BaseException as exc:  # re-raised in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if errors:
        raise errors[0]
    return results


def count_calls(code: object) -> tuple[list[int], Callable[[FrameType, str, object], None]]:
    """A profiler (set per thread with threading.setprofile) counting calls of ``code``."""
    calls: list[int] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code is code:
            calls.append(1)

    return calls, profile


def test_concurrent_first_calls_build_one_manager_and_load_entry_points_once() -> None:
    builds, profile = count_calls(plugins._build_manager.__code__)
    threading.setprofile(profile)  # type: ignore[arg-type]
    try:
        managers = race(plugins.get_plugin_manager)
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    assert len(builds) == 1
    assert all(pm is managers[0] for pm in managers)
    assert plugins.get_plugin_manager() is managers[0]
    names = [name for name, _ in managers[0].list_name_plugin()]
    assert len(names) == len(set(names)) and {"torch", "mxnet"} <= set(names)
    assert plugins.broken_plugins() == {}


def test_concurrent_load_backend_returns_one_module() -> None:
    modules = race(lambda: plugins.load_backend("numpy"))
    assert all(module is modules[0] for module in modules)
    assert modules[0] is sys.modules["mixprec_numpy"]


def test_concurrent_facade_imports_give_one_facade() -> None:
    sys.modules.pop("mixprec.numpy", None)
    facades = race(lambda: importlib.import_module("mixprec.numpy"))
    assert all(facade is facades[0] for facade in facades)


def test_concurrent_registration_loses_no_plugin() -> None:
    class Observer:
        def __init__(self) -> None:
            self.seen: list[int] = []

        @plugins.hookspecs.hookimpl
        def mixprec_step_skipped(self, step: int, loss_scale: float) -> None:
            self.seen.append(step)

    observers = [Observer() for _ in range(THREADS)]
    counter = iter(range(THREADS))
    lock = threading.Lock()

    def register() -> None:
        with lock:
            index = next(counter)
        plugins.register(observers[index], name=f"observer-{index}")

    race(register)
    plugins.emit_step_skipped(7, 1.0)
    assert [o.seen for o in observers] == [[7]] * THREADS


def test_concurrent_policy_lookups_agree() -> None:
    policies = race(lambda: builtin_preset("O2-bf16"))
    assert all(policy == policies[0] for policy in policies)
    decisions = race(lambda: policies[0].decide("softmax", ["bfloat16"]))  # the decide cache
    assert {d.dtype for d in decisions} == {"bfloat16"}
