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

What is alive at the peak: ``python -m benchmarks.memory [CONTENDER ...]`` runs the same
build and two steps under the profiler with shapes and Python stacks recorded
(:func:`peak_breakdown`, not part of the case: stacks slow the run) and prints the
allocations live at the peak of the replay, grouped by the operator and the line of code
that made them.
"""

from __future__ import annotations

import argparse
import resource
import sys
from collections.abc import Sequence
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


_HELPERS = ("aten::empty", "aten::empty_strided")
"""Allocating operators named by the operator that called them instead, where one did."""


def _op_label(node: Any) -> str:
    """``aten::addmm(bfloat16 [8192, 512], ...)``: the operator and its floating inputs."""
    inputs = []
    for value in node.typed[1].inputs:
        if getattr(value, "dtype", None) is not None and getattr(value, "sizes", None):
            inputs.append(f"{str(value.dtype).removeprefix('torch.')} {list(value.sizes)}")
    return f"{node.name}({', '.join(inputs)})"


def _live_at_peak(prof: Any) -> tuple[int, list[tuple[int, str]]]:
    """The peak of the replayed CPU allocations and what was alive then: (bytes, label) per
    allocation, labelled with the innermost operator that is not an allocation helper and the
    innermost Python line outside torch."""
    from torch._C._profiler import _EventType

    allocations: list[tuple[int, int, int, str]] = []  # time, address, bytes (< 0: free), label

    def walk(node: Any, op: str, line: str) -> None:
        kind = node.typed[0]
        if kind == _EventType.Allocation:
            fields = node.typed[1]
            if fields.device.type == "cpu":
                allocations.append((node.start_time_ns, fields.ptr, fields.alloc_size, op + line))
            return
        if kind == _EventType.TorchOp and (not op or node.name not in _HELPERS):
            op = _op_label(node)
        elif kind == _EventType.PyCall:
            try:
                name = node.name
            except UnicodeDecodeError:  # a frame name the profiler stored cut
                name = ""
            if name and not name.startswith("torch/") and "site-packages" not in name:
                line = f" in {name}"
        for child in node.children:
            walk(child, op, line)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, "", "")
    allocations.sort(key=lambda a: a[0])
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: list[tuple[int, str]] = []
    for _, address, nbytes, label in allocations:
        if nbytes > 0:
            live[address] = (nbytes, label)
        else:
            live.pop(address, None)
        total += nbytes
        if total > peak:
            peak, at_peak = total, list(live.values())
    return peak, at_peak


def peak_breakdown(contender: str) -> tuple[float, list[tuple[str, int, float]]]:
    """The peak tensor memory of ``contender`` (MiB) and what was alive at the peak, largest
    first: (label, allocations, MiB) per operator and line of code."""
    setup_torch()
    from torch.profiler import ProfilerActivity, profile

    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        step = make_step(contender, "activations")
        step()
        step()
    peak, live = _live_at_peak(prof)
    groups: dict[str, list[int]] = {}
    for nbytes, label in live:
        groups.setdefault(label, []).append(nbytes)
    rows = [(label, len(sizes), sum(sizes) / MIB) for label, sizes in groups.items()]
    rows.sort(key=lambda row: -row[2])
    return peak / MIB, rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.memory", description="What is alive at the peak."
    )
    parser.add_argument("contenders", nargs="*", default=list(CONTENDERS))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    for contender in args.contenders:
        peak, rows = peak_breakdown(contender)
        print(f"{contender}: peak {peak:.2f} MiB")
        for label, count, mib in rows:
            if mib >= 0.25:
                print(f"  {mib:8.2f} MiB  {count:3d} ×  {label}")
        small = sum(mib for _, _, mib in rows if mib < 0.25)
        print(f"  {small:8.2f} MiB        the rest (groups under 0.25 MiB)")
    return 0


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


if __name__ == "__main__":
    sys.exit(main())
