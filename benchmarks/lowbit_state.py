"""Case 13 — optimizer state in 8 and 4 bits, side by side (issue 35 item 6).

mixprec's ``state=int8|int4|fp8`` (:mod:`mixprec.numerics.lowbit`) against float32 AdamW
and the low-bit AdamWs of bitsandbytes and torchao, on two tasks trained from the same seed
(same init, same batches) by every contender:

- **teacher-student MLP** (the issue's task): a student 128 → 512 → 512 → 128 (GELU,
  394,368 parameters) regresses a fixed random teacher of the same shape (MSE), AdamW lr
  1e-3, batch 128, 400 steps;
- **digits CNN**: case 7's CNN (:func:`benchmarks.accuracy._torch_cnn`) on
  ``sklearn.datasets.load_digits``, AdamW lr 3e-3 (case 7's), batch 64, 10 epochs (220
  steps); its test accuracy is reported too.

Contenders: ``torch.optim.AdamW(fused=True)`` with float32 state; mixprec ``O0``,
``O2-bf16`` and ``O3-bf16-sr`` with float32 state and with low-bit state (every mixprec row
wraps the same fused AdamW); ``bitsandbytes.optim.AdamW8bit`` and ``torchao.optim``'s
``AdamW8bit``, ``AdamW4bit`` and ``AdamWFp8`` when installed (``make bench-lowbit``). Every
AdamW has lr, betas (0.9, 0.999), eps 1e-8 and weight decay 0.01. The bfloat16 rows train
only the MLP: on a CPU without AVX512-BF16 their matmuls are emulated and slow, and the
optimizer is what is measured.

The contenders of a task train in one process, in *lockstep*: each step of the run goes
round every contender (starting from a different one each step), so a slow phase of a busy
machine hits them all alike. Per contender:

- **final loss**: the mean training loss of the last 20 steps, and its ratio to the same
  policy with float32 state (``O0`` for the ``O0,state=...`` rows, ``O2-bf16`` and
  ``O3-bf16-sr`` for theirs, torch's fused AdamW for bitsandbytes' and torchao's);
- **optimizer state**: bytes of the distinct tensor storages in ``optimizer.state`` after the
  last step, per parameter (a tensor subclass, torchao's quantized state, counts its inner
  tensors; bitsandbytes' shared quantization maps count once); **weights + optimizer
  state** adds the parameters, float32 masters and compensation buffers kept between steps
  (case 10's count);
- **optimizer step**: ``optimizer.step()`` alone, timed after an untimed forward and
  backward, the median over the steps after the first 20 (torchao compiles its step at the
  first call).

``python -m benchmarks.lowbit_state RUN.json`` prints a run's figures as the tables of
docs/benchmarks.md's section on this case.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.runner import (
    Case,
    Job,
    JobResult,
    Measurement,
    Options,
    error_text,
    fmt,
    log,
    setup_torch,
)
from benchmarks.state_memory import storage_bytes

CASE_NAME = "lowbit_state"
FUSED = "torch AdamW (fused)"
BNB = "bitsandbytes AdamW8bit"
TORCHAO = ("torchao AdamW8bit", "torchao AdamW4bit", "torchao AdamWFp8")
#: mixprec rows: the policy, and the same policy with float32 state its loss is divided by
MIXPREC: dict[str, str | None] = {
    "O0": None,
    "O0,state=int8": "O0",
    "O0,state=int4": "O0",
    "O0,state=fp8": "O0",
    "O2-bf16": None,
    "O2-bf16,state=int8": "O2-bf16",
    "O3-bf16-sr": None,
    "O3-bf16-sr,state=int8": "O3-bf16-sr",
}
BF16 = ("O2-bf16", "O2-bf16,state=int8", "O3-bf16-sr", "O3-bf16-sr,state=int8")
ROWS = (FUSED, *MIXPREC, BNB, *TORCHAO)
#: the float32-state row each row's loss is divided by (none for the float32 rows)
REFERENCE: dict[str, str] = {
    **{row: ref for row, ref in MIXPREC.items() if ref is not None},
    BNB: FUSED,
    **dict.fromkeys(TORCHAO, FUSED),
}
INSTALL = "make bench-lowbit"

MLP, CNN = "teacher-student MLP", "digits CNN"
WIDTH, HIDDEN = 128, 512
MLP_BATCH, MLP_STEPS, MLP_LR = 128, 400, 1e-3
CNN_EPOCHS, CNN_LR = 10, 3e-3
BETAS, EPS, WEIGHT_DECAY = (0.9, 0.999), 1e-8, 0.01
TAIL = 20  # the final loss is the mean of the last TAIL steps' losses
WARMUP = 20  # steps before the step timer's samples start

LOSS = "final loss"
RATIO = "loss ÷ float32 state"
STATE = "optimizer state"
KEPT = "weights + optimizer state"
STEP = "optimizer step"
ACCURACY = "test accuracy"


# ----------------------------------------------------------------------------- bytes


def leaves(t: Any) -> Iterator[Any]:
    """The plain tensors behind ``t``: a tensor subclass that flattens (torchao's quantized
    state: codes, scales, map) stands for its inner tensors, whose storages hold its bytes
    (its own storage reports the float32 tensor it poses as)."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None:
        yield t
        return
    for name in flatten()[0]:
        yield from leaves(getattr(t, name))


def state_tensors(opt: Any) -> list[Any]:
    """Every tensor in ``opt.state`` (step counters included), subclasses flattened."""
    import torch

    out: list[Any] = []
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                out.extend(leaves(value))
    return out


def kept_bytes(model: Any, opt: Any) -> tuple[int, int]:
    """(bytes of the optimizer state, bytes of the weights, float32 masters and compensation
    buffers) kept between steps, each storage counted once."""
    st = getattr(opt, "_mixprec", None)
    weights = [*model.parameters(), *model.buffers()]
    masters = [p for g in opt.param_groups for p in g["params"]] if st is not None else []
    comp = getattr(st.group.compensation, "flats", []) if st is not None else []
    state = state_tensors(opt)
    return storage_bytes(state), storage_bytes([*weights, *masters, *(f.comp for f in comp)])


# ----------------------------------------------------------------------------- contenders


def make_optimizer(row: str, params: Iterable[Any], lr: float) -> Any:
    """The row's AdamW over ``params`` (mixprec rows: the fused AdamW that ``wrap`` wraps).

    :raises ModuleNotFoundError: bitsandbytes or torchao is not installed.
    """
    import torch

    args: dict[str, Any] = {"lr": lr, "betas": BETAS, "eps": EPS, "weight_decay": WEIGHT_DECAY}
    if row == BNB:
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, **args)
    if row in TORCHAO:
        import torchao.optim

        return getattr(torchao.optim, row.split()[-1])(params, **args)
    return torch.optim.AdamW(params, fused=True, **args)


@dataclass
class Run:
    """One contender training one task: its model, optimizer and what it recorded."""

    row: str
    model: Any
    opt: Any
    wrapped: bool
    losses: list[float] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)

    def step(self, loss_of: Callable[[Any], Any], timed: bool) -> None:
        """One training step; ``optimizer.step()`` alone is timed."""
        self.opt.zero_grad(set_to_none=True)
        loss = loss_of(self.model)
        if self.wrapped:
            import mixprec.torch as mpt

            with mpt.scale_loss(loss, self.opt) as scaled:
                scaled.backward()
        else:
            loss.backward()
        start = time.perf_counter()
        self.opt.step()
        elapsed = time.perf_counter() - start
        self.losses.append(float(loss.detach()))
        if timed:
            self.steps.append(elapsed)


def start(row: str, build: Callable[[], Any], lr: float, seed: int) -> Run:
    """The row's fresh model (``build()``, seeded by the caller) and optimizer."""
    model = build()
    opt = make_optimizer(row, model.parameters(), lr)
    wrapped = row in MIXPREC
    if wrapped:
        import mixprec.torch as mpt

        model, opt = mpt.wrap(model, opt, policy=row, seed=seed)
    return Run(row, model, opt, wrapped)


def not_installed(row: str, exc: BaseException) -> str:
    if isinstance(exc, ModuleNotFoundError):
        return f"not installed ({INSTALL}): {error_text(exc)}"
    return error_text(exc)


def lockstep(
    group: str,
    rows: Sequence[str],
    build: Callable[[int], Any],
    lr: float,
    batches: Sequence[Callable[[Any], Any]],
    seed: int,
    warmup: int,
    failed: dict[str, str],
) -> list[Run]:
    """Train every row on the same batches, one step of each in turn (the starting row
    rotating every step); a row that fails is recorded in ``failed`` and dropped."""
    import torch

    runs: list[Run] = []
    for row in rows:
        if row in failed:
            continue
        try:
            torch.manual_seed(seed)
            runs.append(start(row, lambda: build(seed), lr, seed))
        except Exception as exc:
            failed[row] = not_installed(row, exc)
            log(f"    {group} / {row}: {failed[row]}")
    started = time.perf_counter()
    for i, loss_of in enumerate(batches):
        if i and i % 100 == 0:
            log(f"    {group}: step {i} of {len(batches)} ({time.perf_counter() - started:.0f} s)")
        shift = i % len(runs) if runs else 0
        for run in runs[shift:] + runs[:shift]:
            if run.row in failed:
                continue
            try:
                run.step(loss_of, timed=i >= warmup)
            except Exception as exc:
                failed[run.row] = error_text(exc)
                log(f"    {group} / {run.row}: error at step {i}: {failed[run.row]}")
    return [r for r in runs if r.row not in failed]


def kernels() -> str:
    """Whether mixprec's C kernels ran the codec (or its torch twin did), and which build."""
    try:
        from mixprec_torch.cpu import clib

        return str(clib.info().describe())
    except Exception as exc:
        return f"unknown ({error_text(exc)})"


def versions() -> str:
    """The versions of the other libraries' optimizers (the run's machine lists only its own)."""
    import importlib.metadata

    out = []
    for dist in ("bitsandbytes", "torchao"):
        try:
            out.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{dist} not installed")
    return ", ".join(out)


def _seeds(opts: Options) -> int:
    return opts.seeds if opts.seeds is not None else 1


def collect(
    group: str,
    rows: Sequence[str],
    opts: Options,
    train: Callable[[int, dict[str, str]], tuple[list[Run], Mapping[str, float]]],
) -> JobResult:
    """Train ``rows`` over the seeds and turn what they recorded into measurements."""
    failed: dict[str, str] = {}
    per: dict[str, dict[str, list[float]]] = {row: {} for row in rows}
    started = time.perf_counter()
    seeds = _seeds(opts)
    for seed in range(seeds):
        runs, accuracy = train(seed, failed)
        finals = {r.row: statistics.fmean(r.losses[-TAIL:]) for r in runs}
        for run in runs:
            n = sum(p.numel() for p in run.model.parameters())
            state, weights = kept_bytes(run.model, run.opt)
            figures = per[run.row]
            figures.setdefault(LOSS, []).append(finals[run.row])
            ref = REFERENCE.get(run.row)
            if ref in finals:
                figures.setdefault(RATIO, []).append(finals[run.row] / finals[ref])
            figures.setdefault(STATE, []).append(state / n)
            figures.setdefault(KEPT, []).append((weights + state) / n)
            figures.setdefault(STEP, []).extend(1e3 * s for s in run.steps)
            if run.row in accuracy:
                figures.setdefault(ACCURACY, []).append(100.0 * accuracy[run.row])
    units = {LOSS: "", RATIO: "×", STATE: "B/param", KEPT: "B/param", STEP: "ms", ACCURACY: "%"}
    means = (LOSS, RATIO, ACCURACY)
    out: list[Measurement] = []
    for row in rows:
        if row in failed:
            out.append(Measurement(CASE_NAME, group, row, LOSS, "", error=failed[row]))
            continue
        for metric, samples in per[row].items():
            head = "mean" if metric in means else "median"
            m = Measurement(CASE_NAME, group, row, metric, units[metric], samples, headline=head)
            out.append(m)
            log(f"    {group} / {row} [{metric}]: {fmt(m.value)} {m.unit}")
    spent = time.perf_counter() - started
    lines = [
        f"{group}: {seeds} seed(s), {spent:.0f} s for {len(rows)} contenders in lockstep; "
        f"mixprec's CPU kernels: {kernels()}; {versions()}"
    ]
    return JobResult(out, lines, {"lowbit_seconds": {group: round(spent, 1)}})


# ----------------------------------------------------------------------------- the tasks


def mlp(seed: int) -> Any:
    torch = setup_torch()
    nn = torch.nn
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(WIDTH, HIDDEN), nn.GELU(),
        nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
        nn.Linear(HIDDEN, WIDTH),
    )  # fmt: skip


def teacher_batches(seed: int, steps: int) -> list[Callable[[Any], Any]]:
    """Each step's loss function: the MSE of the student against a random teacher of its
    shape (seed ``1000 + seed``) on fresh Gaussian inputs; the same for every contender."""
    torch = setup_torch()
    teacher = mlp(1000 + seed)
    gen = torch.Generator().manual_seed(seed)
    out: list[Callable[[Any], Any]] = []
    with torch.no_grad():
        for _ in range(steps):
            x = torch.randn(MLP_BATCH, WIDTH, generator=gen)
            y = teacher(x)

            def loss_of(model: Any, x: Any = x, y: Any = y) -> Any:
                return torch.nn.functional.mse_loss(model(x).float(), y)

            out.append(loss_of)
    return out


def run_mlp(opts: Options) -> JobResult:
    """Worker: the teacher-student task, every row."""
    setup_torch()
    steps = 60 if opts.quick else MLP_STEPS
    warmup = opts.warm(WARMUP, 5)

    def train(seed: int, failed: dict[str, str]) -> tuple[list[Run], Mapping[str, float]]:
        batches = teacher_batches(seed, steps)
        return lockstep(MLP, ROWS, mlp, MLP_LR, batches, seed, warmup, failed), {}

    return collect(MLP, ROWS, opts, train)


def run_cnn(opts: Options) -> JobResult:
    """Worker: the digits CNN, every row but the bfloat16 ones."""
    from benchmarks.accuracy import _torch_cnn, batches, digits

    torch = setup_torch()
    rows = tuple(r for r in ROWS if r not in BF16)
    epochs = 2 if opts.quick else CNN_EPOCHS
    warmup = opts.warm(WARMUP, 5)
    xtr, ytr, xte, yte = digits()
    xtr_t, ytr_t = torch.from_numpy(xtr).reshape(-1, 1, 8, 8), torch.from_numpy(ytr)
    xte_t = torch.from_numpy(xte).reshape(-1, 1, 8, 8)

    def train(seed: int, failed: dict[str, str]) -> tuple[list[Run], Mapping[str, float]]:
        steps: list[Callable[[Any], Any]] = []
        for epoch in range(epochs):
            for idx in batches(len(xtr), seed, epoch):

                def loss_of(model: Any, idx: Any = idx) -> Any:
                    out = model(xtr_t[idx]).float()
                    return torch.nn.functional.cross_entropy(out, ytr_t[idx])

                steps.append(loss_of)
        runs = lockstep(CNN, rows, _torch_cnn, CNN_LR, steps, seed, warmup, failed)
        accuracy = {}
        for run in runs:
            run.model.eval()
            with torch.no_grad():
                pred = run.model(xte_t).float().argmax(dim=1).numpy()
            accuracy[run.row] = float((pred == yte).mean())
        return runs, accuracy

    return collect(CNN, rows, opts, train)


def jobs(opts: Options) -> list[Job]:
    return [
        Job("lowbit_state mlp", "benchmarks.lowbit_state:run_mlp", {}, MLP),
        Job("lowbit_state digits", "benchmarks.lowbit_state:run_cnn", {}, CNN),
    ]


CASE = Case(
    name=CASE_NAME,
    title="Optimizer state in 8 and 4 bits: mixprec, bitsandbytes and torchao (PyTorch, CPU)",
    jobs=jobs,
    baselines=(FUSED, BNB),
    groups={
        MLP: f"student MLP {WIDTH}→{HIDDEN}→{HIDDEN}→{WIDTH} (GELU, 394,368 parameters) "
        f"regressing a random teacher of its shape, AdamW {MLP_LR:g}, batch {MLP_BATCH}, "
        f"{MLP_STEPS} steps",
        CNN: f"case 7's digits CNN (38,282 parameters), AdamW {CNN_LR:g}, batch 64, "
        f"{CNN_EPOCHS} epochs; the bfloat16 rows not run",
    },
    order=ROWS,
    method=(
        "Every contender trains the task from the same seed (init and batches), all of them "
        "in one process, one step each in turn. Final loss: the mean training loss of the "
        f"last {TAIL} steps; ÷ float32 state: divided by the same policy's with float32 "
        "state (O0, O2-bf16, O3-bf16-sr; torch's fused AdamW for bitsandbytes and torchao). "
        "State: bytes of the distinct storages in optimizer.state after the last step, per "
        "parameter. Step: optimizer.step() alone after an untimed forward and backward, "
        f"median over the steps after the first {WARMUP}."
    ),
)


# ----------------------------------------------------------------------------- the page


def page_tables(results: Mapping[str, Any]) -> str:
    """The markdown tables of docs/benchmarks.md's section, from a run's ``cases`` entry."""
    found = [Measurement.from_dict(m) for m in results["measurements"]]

    def get(group: str, row: str, metric: str) -> Measurement | None:
        return next(
            (m for m in found if (m.group, m.contender, m.metric) == (group, row, metric)), None
        )

    def error(group: str, row: str) -> str | None:
        m = get(group, row, LOSS)
        return None if m is None or m.ok else m.error

    out: list[str] = []
    for group in (MLP, CNN):
        if not any(m.group == group for m in found):
            continue
        header = ["contender", "final loss", "÷ float32 state", "state B/param",
                  "weights + state B/param", "step ms (median, min–max)",
                  "× fused", "× bnb"]  # fmt: skip
        if group == CNN:
            header.insert(2, "test accuracy %")
        lines = [f"**{group}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        fused, bnb = get(group, FUSED, STEP), get(group, BNB, STEP)
        for row in ROWS:
            if get(group, row, LOSS) is None:
                continue
            why = error(group, row)
            if why is not None:
                cells = [f"`{row}`", f"— ({why})", *[""] * (len(header) - 2)]
                lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
                continue

            def figure(metric: str, digits: int = 3, row: str = row, group: str = group) -> str:
                m = get(group, row, metric)
                return fmt(m.value, digits) if m is not None and m.value is not None else "—"

            step = get(group, row, STEP)
            cells = [f"`{row}`", figure(LOSS, 4), figure(RATIO, 4), figure(STATE),
                     figure(KEPT), "—", "", ""]  # fmt: skip
            if step is not None and step.value is not None:
                cells[5] = f"{fmt(step.value)} ({fmt(step.lo)}–{fmt(step.hi)})"
                for i, base in ((6, fused), (7, bnb)):
                    if base is not None and base.value and base is not step:
                        cells[i] = f"{step.value / base.value:.2f}×"
            if group == CNN:
                cells.insert(2, figure(ACCURACY, 4))
            lines.append("| " + " | ".join(cells) + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def main(argv: Sequence[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m benchmarks.lowbit_state RUN.json", file=sys.stderr)
        return 2
    run = json.loads(Path(argv[0]).read_text())
    print(page_tables(run["cases"][CASE_NAME]), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
