"""Run a worker script on several gloo ranks, one process and one thread each (the torch
tests' multi-process launch: ``test_distributed.py``, ``test_lowbit_fsdp.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


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
