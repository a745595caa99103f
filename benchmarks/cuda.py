"""Case 8 — the PyTorch step models on a CUDA GPU in float16, when one is there.

Same models and loop as :mod:`benchmarks.torch_step`, on ``cuda``, with float16 compute:
``fp32``, ``autocast`` + ``GradScaler`` (float16), ``mixprec O1`` and ``mixprec O2``
(float16 presets, dynamic loss scale). Every sample ends with ``torch.cuda.synchronize()``.
Without a GPU the case prints one line saying why it was skipped.
"""

from __future__ import annotations

from benchmarks.runner import Case, Job, JobResult, Options, compare, setup_torch
from benchmarks.torch_step import MODELS, factory

CONTENDERS = ("fp32", "autocast+GradScaler", "mixprec O1", "mixprec O2")


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
    name = torch.cuda.get_device_name(0)
    cap = ".".join(map(str, torch.cuda.get_device_capability(0)))
    result = JobResult(
        lines=[
            f"GPU: {name} (compute capability {cap}), torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}"
        ],
        meta={"gpu": name},
    )
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32
    torch.backends.cudnn.allow_tf32 = False
    for kind in MODELS:
        result.measurements += compare(
            "cuda",
            kind,
            {c: factory(c, kind, device="cuda", lowp="float16") for c in CONTENDERS},
            warmup=opts.warm(10, 2),
            repeat=opts.reps(50, 5),
        )
    return result


def jobs(opts: Options) -> list[Job]:
    return [Job("cuda", "benchmarks.cuda:run", {}, "cuda")]


CASE = Case(
    name="cuda",
    title="PyTorch on a CUDA GPU, float16, one training step",
    jobs=jobs,
    baselines=("fp32", "autocast+GradScaler"),
    groups=MODELS,
    order=CONTENDERS,
    method=(
        "As the CPU step case, on cuda:0 with float16 compute; TF32 is switched off so that "
        "fp32 is true float32. Each sample ends with torch.cuda.synchronize()."
    ),
)
