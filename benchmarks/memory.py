"""Case 5 — peak memory of a training step (PyTorch, CPU), one fresh process per contender.

The model is activation-heavy: 6 × (Linear 512→512 + GELU) on a batch of 8192, so the saved
activations (~200 MB in float32) dwarf the weights (~6 MB) and the AdamW state. Contenders:
``fp32``, ``autocast`` (bfloat16), ``mixprec O1-bf16`` and ``mixprec O2-bf16``.

Two methods, each in processes of its own:

- **peak tensor memory** (the figure the target uses): the whole life of the model — building
  it, wrapping it, two training steps (the first creates the AdamW state) — runs under
  ``torch.profiler.profile(profile_memory=True)``. Every CPU allocation and free the profiler
  records is replayed in time order; the peak of the running sum is the most tensor memory
  alive at once. It counts exactly what PyTorch's allocator hands out (weights, masters,
  gradients, optimizer state, activations, temporaries) and nothing else; the number is
  deterministic for a given build of PyTorch.
- **peak RSS growth** (a cross-check): without the profiler, ``ru_maxrss`` after the two steps
  minus ``ru_maxrss`` before the model is built. It includes allocator caching and library
  buffers, and misses memory freed back to the OS and re-used below an earlier high-water mark.
"""

from __future__ import annotations

import resource
from typing import Any

from benchmarks.runner import Case, Job, JobResult, Measurement, Options, error_text, setup_torch
from benchmarks.torch_step import make_step

GROUP = "activations"
CONTENDERS = ("fp32", "autocast", "mixprec O1-bf16", "mixprec O2-bf16")
TENSOR = "peak tensor memory"
RSS = "peak RSS growth"
MIB = 2**20


def _replay_peak(prof: Any) -> float:
    """Peak of the running sum of the CPU allocations/frees recorded by the profiler (bytes)."""
    from torch.autograd import DeviceType  # type: ignore[attr-defined]

    events = [
        e
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == DeviceType.CPU
    ]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    if not events:
        raise RuntimeError("the profiler recorded no memory events")
    return float(peak)


def tensor_peak(opts: Options, contender: str) -> JobResult:
    """Worker: peak live tensor bytes of building ``contender`` and running two steps."""
    setup_torch()
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step = make_step(contender, "activations")
            step()
            step()
        samples = [_replay_peak(prof) / MIB]
        error = None
    except Exception as exc:
        samples, error = [], error_text(exc)
    return JobResult([Measurement("memory", GROUP, contender, TENSOR, "MiB", samples, error)])


def rss_peak(opts: Options, contender: str) -> JobResult:
    """Worker: growth of the process's peak RSS over building ``contender`` and two steps."""
    torch = setup_torch()
    try:
        if contender.startswith("mixprec"):
            import mixprec

            mixprec.torch.wrap  # noqa: B018 - load the backend before the baseline
        torch.zeros(1).sum()  # first-op initialisation before the baseline
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        step = make_step(contender, "activations")
        step()
        step()
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        samples, error = [(after - before) / 1024], None  # ru_maxrss is in KiB on Linux
    except Exception as exc:
        samples, error = [], error_text(exc)
    return JobResult([Measurement("memory", GROUP, contender, RSS, "MiB", samples, error)])


def jobs(opts: Options) -> list[Job]:
    out = []
    for contender in CONTENDERS:
        kw = {"contender": contender}
        out.append(
            Job(
                f"memory {contender} tensors", "benchmarks.memory:tensor_peak", kw, GROUP, contender
            )
        )
        for _ in range(opts.reps(3, 1)):
            out.append(
                Job(f"memory {contender} rss", "benchmarks.memory:rss_peak", kw, GROUP, contender)
            )
    return out


CASE = Case(
    name="memory",
    title="Peak memory of a training step (PyTorch, CPU)",
    jobs=jobs,
    baselines=("fp32", "autocast"),
    groups={GROUP: "6 × (Linear 512→512 + GELU), batch 8192, AdamW, two steps"},
    order=CONTENDERS,
    method=(
        "One fresh process per contender and method. Peak tensor memory: model construction, "
        "wrap and two training steps under torch.profiler(profile_memory=True); the recorded "
        "allocations and frees are replayed in time order and the peak of the running total is "
        "reported. Peak RSS growth: ru_maxrss after two steps minus ru_maxrss before the model "
        "is built, without the profiler (one process per sample)."
    ),
)
