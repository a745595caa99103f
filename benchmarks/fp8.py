"""FP8 recipes against bfloat16: accuracy over seeds, the memory of a step, CPU speed.

``python -m benchmarks.fp8 [--seeds 5] [--quick] [--json OUT]`` prints markdown tables:

1. **Accuracy**, each policy over the seeds (mean ± sd, min–max), on four tasks:
   - the digits CNN of case 7 (:func:`benchmarks.accuracy.train_torch`, 10 epochs): test
     accuracy; FP8 runs its two Linear layers (the convolutions stay bfloat16);
   - a teacher-student MLP (32 → 128 → 128 → 8, GELU, Adam): test MSE;
   - the same with a planted outlier row (a dead unit whose weights are 2**20 times the
     others, as :mod:`tests.torch.test_fp8_stats` plants): test MSE; per-tensor scaling
     flushes the rest of that weight to zero;
   - a tiny character-level transformer (2 blocks, width 64, attention through ``nn.Linear``
     projections and ``scaled_dot_product_attention``) on this repository's guide: test
     loss in bits per character.
2. **Memory**: the bytes a training step of the transformer keeps for its backward pass
   (``torch.autograd.graph.saved_tensors_hooks``), per policy.
3. **CPU speed**: one training step of a 3-layer MLP (1024 wide, batch 256), one thread,
   round-robin, median of the timed rounds, per policy, ``torch._scaled_mm`` and emulated.

Everything runs on one torch thread (small tensors, a shared CPU). No FP8 hardware here:
the speed table shows what FP8 costs on a CPU, not what it gains on a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
import mixprec.torch as mpt
from mixprec_torch.fp8.numerics import native_gemms

POLICIES = (
    "O1-bf16",
    "O1-fp8",
    "O1-fp8,fp8=rowwise",
    "O1-fp8,fp8=delayed",
    "O1-fp8,fp8=mxfp8",
)
ROOT = Path(__file__).resolve().parent.parent


def _train_loop(
    model: nn.Module, opt: Any, batches: Sequence[Any], loss_of: Callable[..., Any]
) -> None:
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, batch)
        with mpt.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()


# ------------------------------------------------------------------------------- tasks


def digits(policy: str, seed: int, quick: bool) -> float:
    """Test accuracy (%) of case 7's digits CNN."""
    from benchmarks.accuracy import train_torch

    torch.set_num_threads(1)
    return 100.0 * train_torch(policy, seed, 2 if quick else 10)


def teacher_student(policy: str, seed: int, quick: bool, outlier: bool = False) -> float:
    """Test MSE (x1e3) of a student MLP fitting a fixed teacher."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(1000)
    teacher = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    torch.manual_seed(seed)
    student = nn.Sequential(
        nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 8)
    )
    if outlier:
        with torch.no_grad():
            student[2].weight[0] *= 2.0**20
            student[2].bias[0] = -1e9  # a dead unit: no gradient shrinks its row
    opt = torch.optim.Adam(student.parameters(), lr=2e-3)
    student, opt = mpt.wrap(student, opt, policy=policy)
    steps = 60 if quick else 300
    xs = [torch.randn(128, 32, generator=gen) for _ in range(steps)]
    with torch.no_grad():
        batches = [(x, teacher(x) * 4) for x in xs]
    _train_loop(student, opt, batches, lambda m, b: F.mse_loss(m(b[0]).float(), b[1]))
    x = torch.randn(2048, 32, generator=gen)
    with torch.no_grad():
        return 1e3 * float(F.mse_loss(student(x).float(), teacher(x) * 4))


class Block(nn.Module):
    """Pre-norm transformer block with ``nn.Linear`` projections (so they can run in FP8)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class CharLM(nn.Module):
    """A tiny character-level transformer language model."""

    def __init__(self, vocab: int, width: int = 64, context: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.Sequential(*(Block(width, 4) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.norm(self.blocks(x)))


def _corpus() -> tuple[torch.Tensor, int]:
    text = (ROOT / "docs" / "guide.md").read_text(encoding="utf-8")
    chars = sorted(set(text))
    index = {ch: i for i, ch in enumerate(chars)}
    return torch.tensor([index[ch] for ch in text], dtype=torch.long), len(chars)


def _windows(data: torch.Tensor, gen: torch.Generator, n: int, context: int = 32) -> torch.Tensor:
    starts = torch.randint(0, len(data) - context - 1, (n,), generator=gen)
    return torch.stack([data[s : s + context + 1] for s in starts.tolist()])


def char_lm(policy: str, seed: int, quick: bool) -> float:
    """Test loss in bits per character of the tiny transformer."""
    data, vocab = _corpus()
    split = int(0.9 * len(data))
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = CharLM(vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = mpt.wrap(model, opt, policy=policy)
    steps = 40 if quick else 200
    batches = [_windows(data[:split], gen, 32) for _ in range(steps)]

    def loss_of(m: nn.Module, w: torch.Tensor) -> torch.Tensor:
        logits = m(w[:, :-1]).float()
        return F.cross_entropy(logits.reshape(-1, vocab), w[:, 1:].reshape(-1))

    _train_loop(model, opt, batches, loss_of)
    model.eval()
    test = _windows(data[split:], torch.Generator().manual_seed(123), 256)
    with torch.no_grad():
        return float(loss_of(model, test)) / 0.6931471805599453


TASKS: dict[str, tuple[str, Callable[[str, int, bool], float]]] = {
    "digits CNN": ("test accuracy %, higher is better", digits),
    "teacher-student MLP": ("test MSE ×1e3, lower is better", teacher_student),
    "teacher-student, planted outlier row": (
        "test MSE ×1e3, lower is better",
        lambda p, s, q: teacher_student(p, s, q, outlier=True),
    ),
    "char-level transformer": ("test bits per character, lower is better", char_lm),
}


# ------------------------------------------------------------------------------- memory, speed


def saved_bytes(policy: str) -> int:
    """Bytes one training step of the transformer saves for its backward pass."""
    data, vocab = _corpus()
    torch.manual_seed(0)
    model = CharLM(vocab, width=128)
    model = mpt.wrap(model, torch.optim.AdamW(model.parameters()), policy=policy)[0]
    tokens = _windows(data, torch.Generator().manual_seed(0), 64)
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(
            model(tokens[:, :-1]).float().reshape(-1, vocab), tokens[:, 1:].reshape(-1)
        )
    loss.backward()
    return total


def _mlp_step(policy: str, native: bool) -> Callable[[], None]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024)
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = mpt.wrap(model, opt, policy=policy)
    layers = model._mixprec.group.fp8
    if layers is not None and not native:
        for forward in layers.forwards:
            forward.native = False
    x = torch.randn(256, 1024)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = model(x).float().square().mean()
        with mpt.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()

    return step


def speed(rounds: int) -> dict[str, list[float]]:
    """Step times (ms) per contender, timed round-robin after one warm-up each."""
    contenders = {"O1-bf16": _mlp_step("O1-bf16", True)}
    for policy in POLICIES[1:]:
        recipe = mixprec.get_policy(policy).fp8
        assert recipe is not None
        native = native_gemms("cpu").runs(recipe.name)  # probed, as wrap does
        if native:
            contenders[f"{policy} (torch._scaled_mm)"] = _mlp_step(policy, True)
        contenders[f"{policy} (emulated)"] = _mlp_step(policy, False)
    for step in contenders.values():
        step()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            contenders[name]()
            times[name].append(1e3 * (time.perf_counter() - start))
    return times


# ------------------------------------------------------------------------------- report


def _summary(values: Sequence[float]) -> str:
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.3g} ± {sd:.2g} | {min(values):.3g}–{max(values):.3g}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fp8", description=__doc__)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="1 seed, a few steps: a smoke run")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds of the speed table")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    seeds = 1 if args.quick else args.seeds
    started = time.perf_counter()
    out: dict[str, Any] = {"torch": torch.__version__, "seeds": seeds, "accuracy": {}}
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    for task, (metric, run) in TASKS.items():
        print(f"\n**{task}**: {metric}, {seeds} seed(s)\n")
        print("| policy | mean ± sd | min–max | Δ vs O1-bf16 | time |")
        print("|---|---|---|---|---|")
        rows = {}
        for policy in POLICIES:
            t0 = time.perf_counter()
            values = [run(policy, seed, args.quick) for seed in range(seeds)]
            rows[policy] = values
            delta = statistics.fmean(values) - statistics.fmean(rows["O1-bf16"])
            shown = "" if policy == "O1-bf16" else f"{delta:+.3g}"
            print(
                f"| `{policy}` | {_summary(values)} | {shown} | {time.perf_counter() - t0:.0f} s |"
            )
            sys.stdout.flush()
        out["accuracy"][task] = rows
    print("\n**memory**: bytes a transformer training step saves for backward\n")
    print("| policy | saved for backward | × O1-bf16 |")
    print("|---|---|---|")
    memory = {policy: saved_bytes(policy) for policy in POLICIES}
    for policy, size in memory.items():
        print(f"| `{policy}` | {size / 2**20:.2f} MiB | {size / memory['O1-bf16']:.2f} |")
    out["memory"] = memory
    rounds = 3 if args.quick else args.rounds
    what = f"one MLP training step (3 × 1024², batch 256), median of {rounds} rounds"
    print(f"\n**CPU speed**: {what}\n")
    print("| contender | median ms | min–max | × O1-bf16 |")
    print("|---|---|---|---|")
    times = speed(rounds)
    base = statistics.median(times["O1-bf16"])
    for name, values in times.items():
        med = statistics.median(values)
        print(f"| {name} | {med:.1f} | {min(values):.1f}–{max(values):.1f} | {med / base:.2f} |")
    out["speed_ms"] = times
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
