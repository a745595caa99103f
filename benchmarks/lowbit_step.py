"""The optimizer step with low-bit state on the CPU, path by path (issue 35, item 2).

``python -m benchmarks.lowbit_step`` (one thread: run it as ``OMP_NUM_THREADS=1 python -m
benchmarks.lowbit_step``) times ``optimizer.step()`` of AdamW over float32 parameters of
about 0.4 M and 16 M elements (four tensors each), gradients fixed, in these configurations:

- ``torch fused f32``: ``torch.optim.AdamW(fused=True)``, unwrapped, float32 state (the
  target's reference);
- ``mixprec O0 f32``: the same optimizer wrapped under ``O0`` (float32 state): mixprec's own
  step around it (the guard's pass over the gradients);
- ``O0,state=int8 twin``: the generic path (decode, torch's fused AdamW, encode) with every
  kernel's torch twin, as without the C library (``MIXPREC_NATIVE=0``);
- ``O0,state=int8 codec``: the generic path with the C codec;
- ``O0,state=int8 fused``: the fused native step (``mixprec_torch.lowbit.fused_step``).

Each row is the best of ``--steps`` timed steps after two warm-up steps, as wall time and as
the thread's CPU time (the wall time of a shared machine includes other processes' turns).
Not one of ``python -m benchmarks``' cases: a development measurement, quoted in the
report that introduced the fused step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

import mixprec.torch as mpt
from mixprec_torch.cpu import clib
from mixprec_torch.lowbit.state import LowBitState


class _Params(nn.Module):
    """``count`` float32 tensors of ``size // count`` elements (nothing to run forward)."""

    def __init__(self, size: int, count: int = 4) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.ws = nn.ParameterList(
            nn.Parameter(torch.randn(size // count, generator=g) * 0.02) for _ in range(count)
        )


@contextmanager
def _native(on: bool) -> Iterator[None]:
    saved = dict(clib._state)
    if not on:
        clib._state.clear()
        clib._state.update(lib=None, reason="switched off by the benchmark")
    try:
        yield
    finally:
        clib._state.clear()
        clib._state.update(saved)


@contextmanager
def _fused(on: bool) -> Iterator[None]:
    original = LowBitState.step_fused
    if not on:
        LowBitState.step_fused = lambda self, optimizer: False  # type: ignore[method-assign]
    try:
        yield
    finally:
        LowBitState.step_fused = original  # type: ignore[method-assign]


def _optimizer(size: int, policy: str | None) -> torch.optim.Optimizer:
    net = _Params(size)
    g = torch.Generator().manual_seed(1)
    for p in net.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True)
    if policy is None:
        return opt
    _, wrapped = mpt.wrap(net, opt, policy=policy)
    return wrapped  # type: ignore[no-any-return]


def _time(step: Callable[[], Any], steps: int) -> tuple[float, float, float]:
    """(best wall, best CPU, median wall) seconds over ``steps`` steps after two warm-ups."""
    for _ in range(2):
        step()
    wall, cpu = [], []
    for _ in range(steps):
        w, c = time.perf_counter(), time.thread_time()
        step()
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - w)
    return min(wall), min(cpu), statistics.median(wall)


CONFIGS: dict[str, tuple[str | None, bool, bool]] = {
    # name: (policy, native kernels, fused low-bit step)
    "torch fused f32": (None, True, False),
    "mixprec O0 f32": ("O0", True, False),
    "O0,state={fmt} twin": ("O0,state={fmt}", False, False),
    "O0,state={fmt} codec": ("O0,state={fmt}", True, False),
    "O0,state={fmt} fused": ("O0,state={fmt}", True, True),
}


def run(sizes: list[int], fmt: str, steps: int, twin_steps: int) -> list[dict[str, Any]]:
    rows = []
    for size in sizes:
        reference = None
        for name, (policy, native, fused) in CONFIGS.items():
            label = name.format(fmt=fmt)
            with _native(native), _fused(fused):
                opt = _optimizer(size, None if policy is None else policy.format(fmt=fmt))
                wall, cpu, median = _time(opt.step, twin_steps if not native else steps)
            reference = cpu if reference is None else reference
            rows.append(
                {"size": size, "config": label, "wall": wall, "cpu": cpu, "median": median,
                 "ratio": cpu / reference}
            )  # fmt: skip
            print(
                f"{size / 1e6:6.1f} M  {label:26s} wall {wall * 1e3:9.2f} ms  "
                f"cpu {cpu * 1e3:9.2f} ms  (median wall {median * 1e3:9.2f})  "
                f"{cpu / reference:6.2f}x torch fused f32",
                flush=True,
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="400000,16000000", help="parameter counts")
    parser.add_argument("--format", default="int8", choices=["int8", "int4", "fp8"])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row")
    parser.add_argument("--twin-steps", type=int, default=2, help="timed steps of the twin")
    parser.add_argument("--threads", type=int, default=1, help="torch's and the kernels'")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{clib.status()}; {args.threads} thread(s)")
    run([int(s) for s in args.sizes.split(",")], args.format, args.steps, args.twin_steps)


if __name__ == "__main__":
    main()
