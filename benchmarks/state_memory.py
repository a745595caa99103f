"""Case 10 — what a policy keeps between steps: weights and optimizer state (issue 14).

Case 1's MLP (4 × Linear 2048→2048 + GELU, 16.8 M parameters) takes one training step under
``fp32``, ``O2-bf16``, ``O3-bf16``, ``O3-bf16-kahan`` and ``O3-bf16-sr`` (each compensated
preset also with ``state=bfloat16``: the optimizer state in bfloat16 between steps) with
Adam or AdamW, then ``optimizer.zero_grad()`` (the default loop's next call). Then the
bytes of every tensor storage that survives are summed, each storage once however many
tensors view it:

- **weights + optimizer state** (issue 14's memory target): the model's parameters and
  buffers, the float32 masters (O2), the compensation buffers (kahan) and every tensor in
  ``optimizer.state`` (under ``state=bfloat16`` views of one flat bfloat16 buffer, counted
  once). A compensated preset's float32 working masters exist only inside
  ``step()`` (their storage is empty between steps) and count what they hold then: nothing.
- **gradients kept after zero_grad()**: what ``zero_grad()`` leaves allocated — the model's
  gradients (None) and, under O2, the float32 master-gradient memory kept for the next step.

The figures are exact byte counts, independent of the machine and of bfloat16 speed. The
batch is 8: it changes no byte counted here.

A second job times ``optimizer.step()`` alone (after an untimed forward and backward) under
O2-bf16, O3-bf16 and the compensated presets: the optimizer-side cost of each strategy,
without the matmuls that dominate a whole step (and that an AVX2-only CPU runs far slower in
bfloat16 than in float32, so whole-step figures from such a machine say nothing about them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from benchmarks.runner import (
    Case,
    Job,
    JobResult,
    Measurement,
    Options,
    compare,
    error_text,
    log,
    setup_torch,
)
from benchmarks.torch_step import build

KAHAN_STATE = "O3-bf16-kahan,state=bfloat16"
SR_STATE = "O3-bf16-sr,state=bfloat16"
POLICIES = ("fp32", "O2-bf16", "O3-bf16", "O3-bf16-kahan", "O3-bf16-sr", KAHAN_STATE, SR_STATE)
STEP_POLICIES = ("O2-bf16", "O3-bf16", "O3-bf16-kahan", "O3-bf16-sr", KAHAN_STATE, SR_STATE)
OPTIMIZERS = ("AdamW", "Adam")
BATCH = 8
KEPT = "weights + optimizer state"
GRADS = "gradients kept after zero_grad()"
STEP = "optimizer step only"
STEP_GROUP = "step only, AdamW"
MIB = 2**20


def storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once;
    an empty storage, such as a compensated preset's working masters between steps, counts
    nothing)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes:
            seen[(str(t.device), storage.data_ptr())] = nbytes
    return sum(seen.values())


def _setup(policy: str, optimizer: str) -> tuple[Any, Any, Callable[[], None]]:
    """The MLP and its optimizer under ``policy``, and one default-loop training step."""
    torch = setup_torch()
    model, x, y, loss_fn = build("mlp")
    x, y = x[:BATCH], y[:BATCH]
    opt = getattr(torch.optim, optimizer)(model.parameters(), lr=1e-4)
    if policy != "fp32":
        import mixprec

        model, opt = mixprec.torch.wrap(model, opt, policy=policy)

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x).float(), y).backward()
        opt.step()

    return model, opt, step


def _kept(model: Any, opt: Any) -> tuple[dict[str, int], int]:
    """(bytes per kind of what stays between steps, bytes of the gradients kept)."""
    st = getattr(opt, "_mixprec", None)
    weights = [*model.parameters(), *model.buffers()]
    masters = [p for g in opt.param_groups for p in g["params"]] if st is not None else []
    compensation = getattr(st.group.compensation, "flats", []) if st is not None else []
    comp = [flat.comp for flat in compensation]
    state = [v for s in opt.state.values() for v in s.values() if hasattr(v, "untyped_storage")]
    parts = {"weights": storage_bytes(weights)}
    # masters that are the weights themselves (O3, fp32 params) count once, as weights
    parts["masters"] = storage_bytes([*weights, *masters]) - parts["weights"]
    parts["compensation"] = storage_bytes(comp)
    parts["optimizer state"] = storage_bytes(state)
    grads = [p.grad for p in [*model.parameters(), *masters] if p.grad is not None]
    spare = [] if st is None else [s for s, *_ in st.spare_grads.values()]
    kept_grads = storage_bytes(grads) + sum({s.data_ptr(): s.nbytes() for s in spare}.values())
    return parts, kept_grads


def count(opts: Options, optimizer: str) -> JobResult:
    """Worker: one step per policy, then the bytes each keeps between steps."""
    setup_torch()
    out: list[Measurement] = []
    lines: list[str] = []
    for policy in POLICIES:
        try:
            model, opt, step = _setup(policy, optimizer)
            step()
            opt.zero_grad()
            parts, grads = _kept(model, opt)
            n = sum(p.numel() for p in model.parameters())
            total = sum(parts.values())
            detail = ", ".join(f"{k} {v / MIB:.0f}" for k, v in parts.items())
            note = f"{total / n:.1f} B/param ({detail} MiB)"
            lines.append(f"{optimizer} / {policy}: {note}; gradients kept {grads / MIB:.0f} MiB")
            log(f"    {optimizer} / {policy}: {note}")
            out.append(Measurement("state_memory", optimizer, policy, KEPT, "MiB",
                                   [total / MIB], note=note))  # fmt: skip
            out.append(Measurement("state_memory", optimizer, policy, GRADS, "MiB", [grads / MIB]))
            del model, opt, step
        except Exception as exc:
            out.append(Measurement("state_memory", optimizer, policy, KEPT, "MiB",
                                   error=error_text(exc)))  # fmt: skip
    return JobResult(out, lines)


def step_time(opts: Options) -> JobResult:
    """Worker: ``optimizer.step()`` alone, after an untimed forward and backward."""
    setup_torch()

    def factory(policy: str) -> Callable[[], Callable[[], Mapping[str, float]]]:
        def setup() -> Callable[[], Mapping[str, float]]:
            model, opt, _ = _setup(policy, "AdamW")
            torch = setup_torch()
            x = torch.randn(BATCH, 2048)
            y = torch.randint(0, 2048, (BATCH,))

            def sample() -> Mapping[str, float]:
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x).float(), y).backward()
                start = time.perf_counter()
                opt.step()
                return {STEP: time.perf_counter() - start}

            return sample

        return setup

    found = compare(
        "state_memory",
        STEP_GROUP,
        {p: factory(p) for p in STEP_POLICIES},
        warmup=opts.warm(2, 1),
        repeat=opts.reps(15, 3),
        metric=STEP,
    )
    return JobResult(found)


def jobs(opts: Options) -> list[Job]:
    out = [
        Job(f"state_memory {o}", "benchmarks.state_memory:count", {"optimizer": o}, o)
        for o in OPTIMIZERS
    ]
    out.append(Job("state_memory step only", "benchmarks.state_memory:step_time", {}, STEP_GROUP))
    return out


CASE = Case(
    name="state_memory",
    title="What a policy keeps between steps: weights and optimizer state (PyTorch)",
    jobs=jobs,
    baselines=("O2-bf16", "fp32"),
    groups={
        "AdamW": "case 1's MLP (16.8 M parameters), AdamW, after one step and zero_grad()",
        "Adam": "case 1's MLP (16.8 M parameters), Adam, after one step and zero_grad()",
        STEP_GROUP: "case 1's MLP, batch 8: optimizer.step() alone, after an untimed backward",
    },
    order=POLICIES,
    method=(
        "Bytes: one step, then zero_grad(); every surviving tensor storage is counted once "
        "(parameters, buffers, float32 masters, compensation buffers, optimizer.state). "
        "Step only: optimizer.step() timed alone after an untimed forward and backward, "
        "round-robin in one process; not a whole step (issue 14's speed targets are whole "
        "steps)."
    ),
)
