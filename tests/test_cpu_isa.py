"""Every ``cpu_isa`` test, run a second time as on an AVX2-only CPU.

The main run checks what is right for the CPU at hand. On a CPU with AVX512 this test
re-runs the ``cpu_isa``-marked tests in one subprocess under :data:`isa.AVX2_ENV`, so both
branches of each CPU-dependent expectation run on one machine. On an AVX2-only CPU the
main run already is the AVX2 branch and the fast branch cannot run at all: it skips and says
so.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import isa
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_cpu_dependent_tests_pass_as_on_an_avx2_cpu() -> None:
    if not isa.can_emulate_avx2():
        pytest.skip(
            f"this CPU ({isa.describe()}) has no AVX512 to switch off: the cpu_isa tests "
            "ran in the main run as on an AVX2 CPU, and their AVX512-BF16 branch cannot run here"
        )
    env = {**os.environ, **isa.AVX2_ENV}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "cpu_isa", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    # exit code 5: no test carries the marker (nothing to check is a failure here too)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout, run.stdout[-2000:]
