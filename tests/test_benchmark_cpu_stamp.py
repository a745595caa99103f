"""Every generated benchmark table names the CPU it came from (benchmarks/report.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import isa
import pytest

torch = pytest.importorskip("torch")
ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:  # the benchmarks package lives at the repository root
    sys.path.insert(0, ROOT)

from benchmarks import report  # noqa: E402
from benchmarks.runner import Case, JobResult  # noqa: E402

FLAGS = {"avx512f": True, "avx512_bf16": True, "amx_bf16": False, "avx512_fp16": False}


def test_the_stamp_says_native_or_emulated() -> None:
    native = {"capability": "AVX512", "fast": ["bfloat16"], "note": "", "env": {}}
    machine = {"cpu": "AMD EPYC", "cpu_flags": FLAGS, "cpu_isa": native}
    assert report.cpu_stamp(machine) == (
        "AMD EPYC — torch capability AVX512; flags avx512_bf16; fast low precision: bfloat16; "
        "native ISA (not emulated)"
    )
    emulated = {**native, "capability": "AVX2", "fast": [], "env": {"DNNL_MAX_CPU_ISA": "AVX2"}}
    assert report.cpu_stamp({**machine, "cpu_isa": emulated}).endswith(
        "flags avx512_bf16; fast low precision: none; emulated: DNNL_MAX_CPU_ISA=AVX2"
    )
    assert "ISA unknown" in report.cpu_stamp({"cpu": "old run", "cpu_flags": FLAGS})


def test_each_case_section_carries_its_own_cpu() -> None:
    case = Case("x", "A case", lambda opts: [], method="How.")
    rerun = JobResult(meta={"cpu": "another CPU — torch capability AVX2"})
    assert "CPU of these tables: another CPU — torch capability AVX2." in report.case_md(
        1, case, rerun, {"cpu": "this CPU"}
    )


@pytest.mark.cpu_isa
def test_the_runner_asks_torch_about_this_cpu() -> None:
    facts = report.cpu_isa()
    assert facts["capability"] == torch.backends.cpu.get_cpu_capability()
    import mixprec.torch as mpt

    assert facts["fast"] == list(mpt.capabilities().device("cpu").fast_dtypes)
    capped = {var: os.environ[var] for var in report.ISA_VARS if var in os.environ}
    assert facts["env"] == capped
    stamp = report.cpu_stamp({"cpu": "here", "cpu_flags": FLAGS, "cpu_isa": facts})
    assert ("emulated: " in stamp) == bool(capped), stamp
    if isa.emulating_avx2():
        assert facts["fast"] == [] and "DNNL_MAX_CPU_ISA=AVX2" in stamp
