"""Case 1 — PyTorch training step on the CPU in bfloat16, mixprec against torch.amp.

Two models: an MLP (4 × Linear 2048 + GELU, batch 256) and a transformer encoder layer
(d_model 512, 8 heads, feed-forward 2048, sequence 128, batch 32). Contenders:

- ``fp32``: the plain loop.
- ``autocast``: ``torch.autocast("cpu", torch.bfloat16)`` alone (the usual bf16 recipe).
- ``autocast+GradScaler``: autocast plus ``torch.amp.GradScaler("cpu")`` (enabled), the
  recipe mixprec's O1 is compared with in the targets.
- ``mixprec torch-autocast-cpu``: the backend's preset that reproduces autocast + GradScaler
  exactly, so its ratio to that contender is mixprec's own overhead.
- ``mixprec O1-bf16``, ``O2-bf16``, ``O3-bf16``: ``mixprec.torch.wrap`` + ``scale_loss``.
- MLP only: ``mixprec O3-bf16-kahan`` and ``O3-bf16-sr``, the compensated presets (issue 22's
  whole-step targets compare them with O3-bf16 and O2-bf16 of the same run).

One step is zero_grad → forward → loss → backward → AdamW step; every contender starts from
the same weights and batch. The helpers here are shared with :mod:`benchmarks.cuda` and
:mod:`benchmarks.memory`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.runner import Case, Factory, Job, JobResult, Options, compare, log, setup_torch

MODELS = {
    "mlp": "4 × (Linear 2048→2048 + GELU), batch 256, cross-entropy over 2048 classes",
    "transformer": "nn.TransformerEncoderLayer(d_model 512, 8 heads, ff 2048, dropout 0.1), "
    "batch 32 × seq 128, MSE loss",
}
MIXPREC_PRESETS = ("O1-bf16", "O2-bf16", "O3-bf16")
COMPENSATED = ("O3-bf16-kahan", "O3-bf16-sr")


def build(
    kind: str, device: str = "cpu", seed: int = 0
) -> tuple[Any, Any, Any, Callable[..., Any]]:
    """The model, one input batch, its targets and the loss function for ``kind``."""
    torch = setup_torch()
    nn = torch.nn
    torch.manual_seed(seed)
    if kind == "mlp":
        layers: list[Any] = []
        for _ in range(4):
            layers += [nn.Linear(2048, 2048), nn.GELU()]
        model = nn.Sequential(*layers)
        x = torch.randn(256, 2048)
        y = torch.randint(0, 2048, (256,))
        loss_fn = nn.functional.cross_entropy
    elif kind == "transformer":
        model = nn.TransformerEncoderLayer(512, 8, dim_feedforward=2048, batch_first=True)
        x = torch.randn(32, 128, 512)
        y = torch.randn(32, 128, 512)
        loss_fn = nn.functional.mse_loss
    elif kind == "activations":  # memory case: activations dominate params by far
        layers = []
        for _ in range(6):
            layers += [nn.Linear(512, 512), nn.GELU()]
        model = nn.Sequential(*layers)
        x = torch.randn(8192, 512)
        y = torch.randint(0, 512, (8192,))
        loss_fn = nn.functional.cross_entropy
    else:
        raise ValueError(f"unknown model {kind!r}")
    return model.to(device), x.to(device), y.to(device), loss_fn


def make_step(
    contender: str, kind: str, device: str = "cpu", lowp: str = "bfloat16"
) -> Callable[[], None]:
    """Set up one contender on a fresh copy of ``kind`` and return its training step.

    ``contender`` is ``fp32``, ``autocast``, ``autocast+GradScaler`` or ``mixprec <preset>``.
    """
    torch = setup_torch()
    model, x, y, loss_fn = build(kind, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dtype = getattr(torch, lowp)
    dev_type = torch.device(device).type
    sync = torch.cuda.synchronize if dev_type == "cuda" else (lambda: None)

    if contender == "fp32":

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()
            sync()

    elif contender == "autocast":

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(dev_type, dtype=dtype):
                loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            sync()

    elif contender == "autocast+GradScaler":
        scaler = torch.amp.GradScaler(dev_type, enabled=True)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(dev_type, dtype=dtype):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sync()

    elif contender.startswith("mixprec "):
        import mixprec

        policy = contender.split(" ", 1)[1]
        model, opt = mixprec.torch.wrap(model, opt, policy=policy)
        scale_loss = mixprec.torch.scale_loss

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            # written like the autocast step: no name keeps the output alive through backward
            loss = loss_fn(model(x).float(), y)  # .float(): O3 outputs bf16
            with scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            sync()

    else:
        raise ValueError(f"unknown contender {contender!r}")
    return step


def factory(contender: str, kind: str, device: str = "cpu", lowp: str = "bfloat16") -> Factory:
    def setup() -> Callable[[], None]:
        return make_step(contender, kind, device, lowp)

    return setup


# torch-autocast-cpu is the backend's preset equal to autocast + GradScaler (bf16 on the CPU):
# the same semantics through mixprec, so its ratio to autocast+GradScaler is pure overhead.
CONTENDERS = (
    "fp32",
    "autocast",
    "autocast+GradScaler",
    "mixprec torch-autocast-cpu",
    *(f"mixprec {p}" for p in MIXPREC_PRESETS),
)
#: the MLP's contenders: the compensated presets too
MLP_CONTENDERS = (*CONTENDERS, *(f"mixprec {p}" for p in COMPENSATED))


def run_model(opts: Options, kind: str) -> JobResult:
    """Worker: every contender on one model, timed round-robin in this process."""
    setup_torch()
    names = MLP_CONTENDERS if kind == "mlp" else CONTENDERS
    log(f"  torch_step / {kind}: {len(names)} contenders")
    contenders = {name: factory(name, kind) for name in names}
    measurements = compare(
        "torch_step",
        kind,
        contenders,
        warmup=opts.warm(3, 1),
        repeat=opts.reps(15, 3),
    )
    return JobResult(measurements)


def jobs(opts: Options) -> list[Job]:
    return [
        Job(f"torch_step {k}", "benchmarks.torch_step:run_model", {"kind": k}, k) for k in MODELS
    ]


CASE = Case(
    name="torch_step",
    title="PyTorch, CPU bfloat16, one training step",
    jobs=jobs,
    baselines=("fp32", "autocast+GradScaler"),
    groups=MODELS,
    order=MLP_CONTENDERS,
    method=(
        "One sample = one full training step (zero_grad, forward, loss, backward, AdamW step). "
        "All contenders of a model live in one process and are timed round-robin after warm-up; "
        "the figure is the median step time, with the fastest and slowest sample."
    ),
)
