"""What the step guard costs on a PyTorch step: ``python -m benchmarks.guard_cost``.

Not part of ``python -m benchmarks``' cases (it compares two versions of one internal
check, not mixprec against another library). For each preset it wraps an MLP
(``--width`` wide, 4 layers, batch 64) with Adam, then times, on the same gradients:

- ``before``: the check the step ran before the guard (the fused unscale-and-inf-check,
  run with an inverse scale of 1 under the presets without loss scaling);
- ``after``: the guarded check (the unscale where the loss is scaled, then one fused
  float32 norm per tensor whose summed squares flag inf, NaN and overflow);
- ``step``: one whole training step (forward, backward, guarded step);
- ``bn copy``: the BatchNorm statistics snapshot of one step (a conv net's 2 BatchNorms).

Medians of ``--repeat`` runs, one intra-op thread (on a shared CPU torch's worker threads
spin against other processes).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

import mixprec.torch as mpt
from mixprec_torch.torch_private import foreach_norm_float32, non_finite_check_and_unscale_
from mixprec_torch.wrapping.running_stats import RunningStats


def _median_ms(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def _case(preset: str, width: int, repeat: int) -> tuple[float, float, float]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = mpt.wrap(model, torch.optim.Adam(model.parameters(), lr=1e-4), preset)
    x = torch.randn(64, width)

    def step() -> None:
        opt.zero_grad()
        loss = model(x).float().pow(2).mean()
        with mpt.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()

    step()
    opt.zero_grad()
    loss = model(x).float().pow(2).mean()
    with mpt.scale_loss(loss, opt) as scaled:
        scaled.backward()
    mpt.unscale_(opt)  # the optimizer's (master) gradients, as the check sees them
    grads = [p.grad for p in mpt.master_params(opt) if p.grad is not None]
    scaled_loss = mpt.state(opt).loss_scale != 1.0
    found = torch.zeros(1)
    one = torch.ones(())

    def before() -> None:
        non_finite_check_and_unscale_(grads, found, one)
        found.item()

    def after() -> None:
        if scaled_loss:
            non_finite_check_and_unscale_(grads, found, one)
        squared = torch.stack(foreach_norm_float32(grads)).square().sum()
        found.add_(torch.isfinite(squared).logical_not())
        found.item()

    opt.step()
    return _median_ms(before, repeat), _median_ms(after, repeat), _median_ms(step, repeat // 4)


def _bn_copy(repeat: int) -> float:
    net = nn.Sequential(
        nn.Conv2d(1, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 32, 3), nn.BatchNorm2d(32)
    )
    stats = RunningStats([net])
    x = torch.randn(4, 1, 8, 8)
    net(x)  # allocates the copies

    def copy() -> None:
        stats.settle(False)
        for module in stats.modules:
            stats._before_forward(module, (x,))

    return _median_ms(copy, repeat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--presets", default="O0,O1-bf16,O2-bf16")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, MLP 4 x Linear({args.width}, {args.width}), Adam, 1 thread")
    print(f"{'preset':<10} {'before ms':>10} {'after ms':>10} {'step ms':>10} {'added':>8}")
    for preset in args.presets.split(","):
        before, after, step = _case(preset, args.width, args.repeat)
        added = 100 * (after - before) / step
        print(f"{preset:<10} {before:>10.3f} {after:>10.3f} {step:>10.2f} {added:>7.1f}%")
    print(f"BatchNorm statistics copy (2 BatchNorms, 48 channels): {_bn_copy(args.repeat):.3f} ms")


if __name__ == "__main__":
    main()
