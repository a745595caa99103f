"""Run a worker script on several gloo ranks, one process and one thread each (the torch
tests' multi-process launch: ``test_distributed.py``, ``test_lowbit_fsdp.py``,
``test_lightning_fsdp.py``), and the marks such a test carries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

needs_gloo = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is not available in this build",
)


def multi_rank(timeout: float) -> Callable[[Any], Any]:
    """The marks of a test that starts several gloo processes: slow, distributed, gloo, and
    ``timeout`` seconds for the whole test."""

    def mark(test: Any) -> Any:
        for each in (pytest.mark.timeout(timeout), pytest.mark.slow, pytest.mark.distributed):
            test = each(test)
        return needs_gloo(test)

    return mark


def launch(
    worker: Path, scenarios: list[str], workdir: Path, world: int = 2, timeout: float = 120.0
) -> list[dict[str, Any]]:
    """Run ``worker scenarios rank world workdir`` on ``world`` processes; each rank's
    results (``rank<N>.json``), rank 0 first. A rank that fails or outlives ``timeout``
    fails the test with every rank's log."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONWARNINGS="")
    # The ranks exercise the torch backend only: spare each of them loading the other backends.
    env["MIXPREC_DISABLE_PLUGINS"] = "mxnet"
    command = [sys.executable, str(worker), ",".join(scenarios)]
    procs = []
    logs = []
    for rank in range(world):
        log = (workdir / f"rank{rank}.log").open("w")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [*command, str(rank), str(world), str(workdir)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        )
    try:
        for proc in procs:
            proc.wait(timeout=timeout)  # the ranks run concurrently: one shared budget is enough
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    failed = [rank for rank, proc in enumerate(procs) if proc.returncode != 0]
    if failed:
        output = "\n".join(
            f"--- rank {rank} (exit {procs[rank].returncode}) ---\n"
            + (workdir / f"rank{rank}.log").read_text()[-4000:]
            for rank in range(world)
        )
        pytest.fail(f"rank(s) {failed} failed or timed out\n{output}")
    return [json.loads((workdir / f"rank{rank}.json").read_text()) for rank in range(world)]


def scenario(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """Each rank's result for ``name`` (of :func:`launch`'s results); fails with the rank's
    traceback or warnings."""
    results = []
    for rank, by_name in enumerate(ranks):
        result = by_name.get(name)
        if result is None:
            pytest.fail(f"{name} did not run on rank {rank} (an earlier scenario failed)")
        if "error" in result:
            pytest.fail(f"{name} failed on rank {rank}:\n{result['error']}")
        assert result.pop("warnings") == [], f"{name} warned on rank {rank}"
        results.append(result)
    return results
