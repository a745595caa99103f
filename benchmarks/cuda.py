"""Case 8 — the PyTorch step models on a CUDA GPU, float16 and bfloat16, when one is there.

Same models and loop as :mod:`benchmarks.torch_step`, on ``cuda``. Contenders: ``fp32``;
float16 — ``autocast+GradScaler`` against ``mixprec O1`` and ``mixprec O2`` (dynamic loss
scale); bfloat16 — ``autocast bf16`` (no scaler) against ``mixprec O2-bf16``, ``O3-bf16``
and ``O3-bf16-kahan``. Every sample ends with ``torch.cuda.synchronize()``. Without a GPU
the case prints one line saying why it was skipped. ``make gpu-check`` runs it.
"""

from __future__ import annotations

from typing import Any

from benchmarks.runner import Case, Job, JobResult, Options, compare, setup_torch
from benchmarks.torch_step import MODELS, factory

#: contender -> (the step of benchmarks.torch_step it runs, its low-precision dtype)
CONTENDERS: dict[str, tuple[str, str]] = {
    "fp32": ("fp32", "float16"),
    "autocast+GradScaler": ("autocast+GradScaler", "float16"),
    "mixprec O1": ("mixprec O1", "float16"),
    "mixprec O2": ("mixprec O2", "float16"),
    "autocast bf16": ("autocast", "bfloat16"),
    "mixprec O2-bf16": ("mixprec O2-bf16", "bfloat16"),
    "mixprec O3-bf16": ("mixprec O3-bf16", "bfloat16"),
    "mixprec O3-bf16-kahan": ("mixprec O3-bf16-kahan", "bfloat16"),
}


def gpu_line(torch: Any) -> str:
    """The GPU, its compute capability and the torch/CUDA versions, in one line."""
    cap = ".".join(map(str, torch.cuda.get_device_capability(0)))
    return (
        f"GPU: {torch.cuda.get_device_name(0)} (compute capability {cap}), "
        f"torch {torch.__version__}, CUDA {torch.version.cuda}"
    )


def run(opts: Options) -> JobResult:
    torch = setup_torch()
    if not torch.cuda.is_available():
        built = torch.version.cuda or "no CUDA support in this build"
        return JobResult(
            lines=[
                f"skipped: no CUDA GPU (torch.cuda.is_available() is False; torch "
                f"{torch.__version__}, CUDA: {built})"
            ],
            meta={"gpu": None},
        )
    result = JobResult(lines=[gpu_line(torch)], meta={"gpu": torch.cuda.get_device_name(0)})
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32
    torch.backends.cudnn.allow_tf32 = False
    bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    names = [name for name, (_, lowp) in CONTENDERS.items() if lowp == "float16" or bf16]
    if not bf16:
        result.lines.append("bfloat16 contenders left out: this GPU has no bfloat16 (before 8.0)")
    for kind in MODELS:
        result.measurements += compare(
            "cuda",
            kind,
            {
                name: factory(CONTENDERS[name][0], kind, device="cuda", lowp=CONTENDERS[name][1])
                for name in names
            },
            warmup=opts.warm(10, 2),
            repeat=opts.reps(50, 5),
        )
    return result


def jobs(opts: Options) -> list[Job]:
    return [Job("cuda", "benchmarks.cuda:run", {}, "cuda")]


CASE = Case(
    name="cuda",
    title="PyTorch on a CUDA GPU, float16 and bfloat16, one training step",
    jobs=jobs,
    baselines=("fp32", "autocast+GradScaler"),
    groups=MODELS,
    order=tuple(CONTENDERS),
    method=(
        "As the CPU step case, on cuda:0: float16 (autocast+GradScaler, O1, O2; dynamic loss "
        "scale) and bfloat16 (autocast alone, O2-bf16, O3-bf16, O3-bf16-kahan). TF32 is "
        "switched off so that fp32 is true float32. Each sample ends with "
        "torch.cuda.synchronize()."
    ),
)
