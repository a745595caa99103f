"""Case 10 — ``torch.compile``: a wrapped model compiled against autocast compiled.

Two models, small on purpose (this machine's bfloat16 matmuls are slow, see the page): an MLP
(4 × Linear 256 + GELU, batch 64) and a transformer encoder layer (d_model 128, 4 heads,
feed-forward 512, sequence 32, batch 8). Contenders, each compiled with
``torch.compile`` (inductor) after its set-up:

- ``autocast+compile``: the model compiled, its forward and loss run under
  ``torch.autocast("cpu", torch.bfloat16)``, plain ``loss.backward()`` and AdamW step.
- ``mixprec O1-bf16+compile`` and ``mixprec O2-bf16+compile``: ``wrap`` first, then
  ``torch.compile`` of the wrapped model; ``scale_loss`` and the wrapped optimizer's step.

One sample is zero_grad → forward → loss → backward → AdamW step (the optimizer step stays
eager for every contender). The warm-up includes the compilation (several seconds each).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.runner import Case, Factory, Job, JobResult, Options, compare, log, setup_torch

MODELS = {
    "mlp": "4 × (Linear 256→256 + GELU), batch 64, cross-entropy over 256 classes",
    "transformer": "nn.TransformerEncoderLayer(d_model 128, 4 heads, ff 512, dropout 0), "
    "batch 8 × seq 32, MSE loss",
}
CONTENDERS = ("autocast+compile", "mixprec O1-bf16+compile", "mixprec O2-bf16+compile")


def build(kind: str) -> tuple[Any, Any, Any, Callable[..., Any]]:
    """The model, one batch, its targets and the loss function for ``kind``."""
    torch = setup_torch()
    nn = torch.nn
    torch.manual_seed(0)
    if kind == "mlp":
        layers: list[Any] = []
        for _ in range(4):
            layers += [nn.Linear(256, 256), nn.GELU()]
        return (
            nn.Sequential(*layers),
            torch.randn(64, 256),
            torch.randint(0, 256, (64,)),
            nn.functional.cross_entropy,
        )
    if kind == "transformer":
        model = nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True)
        return model, torch.randn(8, 32, 128), torch.randn(8, 32, 128), nn.functional.mse_loss
    raise ValueError(f"unknown model {kind!r}")


def make_step(contender: str, kind: str) -> Callable[[], None]:
    torch = setup_torch()
    model, x, y, loss_fn = build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if contender == "autocast+compile":
        compiled = torch.compile(model)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(compiled(x), y)
            loss.backward()
            opt.step()

    elif contender.startswith("mixprec ") and contender.endswith("+compile"):
        import mixprec

        policy = contender.removeprefix("mixprec ").removesuffix("+compile")
        model, opt = mixprec.torch.wrap(model, opt, policy=policy)
        compiled = torch.compile(model)
        scale_loss = mixprec.torch.scale_loss

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(compiled(x).float(), y)
            with scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()

    else:
        raise ValueError(f"unknown contender {contender!r}")
    return step


def factory(contender: str, kind: str) -> Factory:
    def setup() -> Callable[[], None]:
        return make_step(contender, kind)

    return setup


def run_model(opts: Options, kind: str) -> JobResult:
    """Worker: every contender on one model, timed round-robin in this process."""
    setup_torch()
    log(f"  compile / {kind}: {len(CONTENDERS)} contenders")
    contenders = {name: factory(name, kind) for name in CONTENDERS}
    return JobResult(
        compare("compile", kind, contenders, warmup=opts.warm(3, 2), repeat=opts.reps(20, 5))
    )


def jobs(opts: Options) -> list[Job]:
    return [
        Job(f"compile {k}", "benchmarks.torch_compile:run_model", {"kind": k}, k) for k in MODELS
    ]


CASE = Case(
    name="compile",
    title="torch.compile: wrapped and compiled against autocast and compiled (PyTorch, CPU)",
    jobs=jobs,
    baselines=("autocast+compile",),
    groups=MODELS,
    order=CONTENDERS,
    method=(
        "One sample = one full training step (zero_grad, compiled forward, loss, backward, "
        "AdamW step). Compiled with inductor during warm-up (the first call compiles); timed "
        "round-robin in one process; median step time with the fastest and slowest sample."
    ),
)
