"""Case 4 — O1 dispatch overhead: per-op casting cost on a deep, narrow network.

The network is 64 residual blocks ``x + LayerNorm(GELU(Linear 32→32 (x)))`` on a batch of 16:
about 260 tiny ops per forward pass, so the time goes into dispatching ops (and deciding their
dtypes), not into arithmetic. Contenders: ``fp32`` (no casting at all, for reference),
``autocast`` (``torch.autocast("cpu", bfloat16)``), ``mixprec torch-autocast-cpu`` (autocast's
own lists through mixprec) and ``mixprec O1-bf16`` (whose lists keep ``layer_norm`` in fp32,
so each LayerNorm call is intercepted); both ``wrap`` the model with no optimizer. One more
contender measures the floor of any design that decides dtypes in Python per op:
``autocast + empty mode`` is ``autocast`` with a ``TorchFunctionMode`` whose
``__torch_function__`` only calls the function. One sample is forward + backward (no
optimizer step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.runner import Case, Factory, Job, JobResult, Options, compare, setup_torch

GROUP = "64 blocks"
CONTENDERS = (
    "fp32",
    "autocast",
    "autocast + empty mode",
    "mixprec torch-autocast-cpu",
    "mixprec O1-bf16",
)


def build() -> tuple[Any, Any]:
    torch = setup_torch()
    nn = torch.nn

    class Block(nn.Module):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(32, 32)
            self.act = nn.GELU()
            self.norm = nn.LayerNorm(32)

        def forward(self, x: Any) -> Any:
            return x + self.norm(self.act(self.linear(x)))

    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(64)]), torch.randn(16, 32)


def make_step(contender: str) -> Callable[[], None]:
    torch = setup_torch()
    model, x = build()
    if contender == "fp32":

        def step() -> None:
            model.zero_grad(set_to_none=True)
            model(x).float().square().mean().backward()

    elif contender == "autocast":

        def step() -> None:
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            out.float().square().mean().backward()

    elif contender == "autocast + empty mode":
        from torch.overrides import TorchFunctionMode

        class EmptyMode(TorchFunctionMode):  # type: ignore[misc]
            def __torch_function__(
                self, func: Any, types: Any, args: Any = (), kwargs: Any = None
            ) -> Any:
                return func(*args, **(kwargs or {}))

        def step() -> None:
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16), EmptyMode():
                out = model(x)
            out.float().square().mean().backward()

    elif contender.startswith("mixprec "):
        import mixprec

        model = mixprec.torch.wrap(model, policy=contender.split(" ", 1)[1])

        def step() -> None:
            model.zero_grad(set_to_none=True)
            model(x).float().square().mean().backward()

    else:
        raise ValueError(f"unknown contender {contender!r}")
    return step


def factory(contender: str) -> Factory:
    def setup() -> Callable[[], None]:
        return make_step(contender)

    return setup


def run(opts: Options) -> JobResult:
    return JobResult(
        compare(
            "dispatch",
            GROUP,
            {name: factory(name) for name in CONTENDERS},
            warmup=opts.warm(10, 2),
            repeat=opts.reps(100, 10),
        )
    )


def jobs(opts: Options) -> list[Job]:
    return [Job("dispatch", "benchmarks.dispatch:run", {}, GROUP)]


CASE = Case(
    name="dispatch",
    title="O1 dispatch overhead, deep narrow network, forward + backward (PyTorch, CPU)",
    jobs=jobs,
    baselines=("fp32", "autocast"),
    groups={GROUP: "64 × (x + LayerNorm(GELU(Linear 32→32 (x)))), batch 16 — ~260 ops forward"},
    order=CONTENDERS,
    method=(
        "One sample = zero_grad, forward, `.float().square().mean()`, backward; no optimizer. "
        "Round-robin in one process. The ratio to autocast is the cost of mixprec's per-op "
        "dtype decisions over torch's built-in autocast dispatch; `autocast + empty mode` is "
        "autocast under a `TorchFunctionMode` that only calls each function (the floor of "
        "deciding per op in Python)."
    ),
)
