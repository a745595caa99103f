"""FP8 on a real GPU: skipped without one, run by ``make gpu-check`` (the ``cuda`` marker).

What the CPU cannot show: whether ``torch._scaled_mm`` runs the recipes on this GPU (compute
capability 8.9+, Ada and Hopper), whether the quantised operands on the device are the CPU's
bit for bit, how close the tensor-core GEMMs come to the exact emulation (they accumulate in
another order, so close, not equal), and training and resuming with FP8 layers on the device.
Not run on a GPU when it was written (no GPU was lent): a failure here is news, not a
known state.
"""

from __future__ import annotations

import io

import pytest

torch = pytest.importorskip("torch")

from _fp8_tasks import fit, start_and_end, teacher  # noqa: E402
from _fp8_tasks import square_step as step  # noqa: E402
from torch import nn  # noqa: E402

import mixprec.torch as mpt  # noqa: E402
from mixprec.kit import FP8_RECIPES  # noqa: E402
from mixprec_torch.fp8.linear import FP8LinearFunction  # noqa: E402
from mixprec_torch.fp8.numerics import native_gemms, quantise  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.cuda]

DEV = "cuda"


def _fp8_gemms() -> bool:
    return torch.cuda.get_device_capability(0) >= (8, 9)


def test_scaled_mm_runs_per_tensor_fp8_where_the_gpu_has_fp8_tensor_cores() -> None:
    native = native_gemms("cuda", 0)
    assert native.tensor == _fp8_gemms(), native
    assert not native.runs("mxfp8")  # always emulated


@pytest.mark.parametrize("recipe", FP8_RECIPES)
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_quantised_operands_on_the_gpu_are_the_cpus_bit_for_bit(recipe: str, fmt: str) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=gen) * torch.logspace(-6, 3, 64)  # a wide range
    x[3, 5] = 0.0
    on_cpu = quantise(x, fmt, recipe, 1)
    on_gpu = quantise(x.to(DEV), fmt, recipe, 1)
    assert torch.equal(on_gpu.q.cpu().float(), on_cpu.q.float())
    assert torch.equal(on_gpu.scale.cpu(), on_cpu.scale)


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_the_fp8_linear_on_the_gpu_is_close_to_the_exact_emulation(recipe: str) -> None:
    torch.manual_seed(1)
    x = (torch.randn(64, 32) * 3).to(DEV)
    w = torch.randn(48, 32).to(DEV)
    b = torch.randn(48).to(DEV)
    native = native_gemms("cuda", 0).runs(recipe)
    results = []
    for use_native in (native, False):
        xi, wi, bi = (t.clone().requires_grad_(True) for t in (x, w, b))
        y, _ = FP8LinearFunction.apply(xi, wi, bi, recipe, use_native, torch.bfloat16, None, None)
        y.float().square().sum().backward()
        results.append((y.detach().float(), xi.grad, wi.grad, bi.grad))
    for got, want in zip(*results, strict=True):
        assert torch.allclose(
            got.float(), want.float(), rtol=2e-2, atol=1e-2 * float(want.abs().max())
        )


def _teacher_student(policy: str, steps: int = 60) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(0)
    target = teacher(out=16, device=DEV)
    torch.manual_seed(1)
    student = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)).to(DEV)
    optimizer = torch.optim.Adam(student.parameters(), lr=1e-2)
    student, optimizer = mpt.wrap(student, optimizer, policy=policy)
    losses: list[float] = []
    fit(student, optimizer, target, gen, steps, losses, DEV)
    return start_and_end(losses)


def test_every_recipe_trains_on_the_gpu_about_as_well_as_bfloat16() -> None:
    start, bf16 = _teacher_student("O1-bf16")
    assert bf16 < start / 10
    for recipe in FP8_RECIPES:
        fp8 = _teacher_student(f"O1-fp8,fp8={recipe}")[1]
        assert fp8 < bf16 * 1.25, f"{recipe}: {fp8} vs bfloat16 {bf16}"


def test_delayed_histories_resume_bit_for_bit_on_the_gpu() -> None:
    def wrapped(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)).to(DEV)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return mpt.wrap(model, optimizer, policy="O2-fp8,fp8=delayed(history=4)")  # type: ignore[no-any-return]

    gen = torch.Generator().manual_seed(7)
    batches = [(torch.randn(32, 16, generator=gen) * (1 + i)).to(DEV) for i in range(8)]
    original, opt = wrapped(0)
    for x in batches[:4]:
        step(original, opt, x)
    buffer = io.BytesIO()
    torch.save({"model": original.state_dict(), "optimizer": opt.state_dict()}, buffer)
    resumed, ropt = wrapped(1)
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    resumed.load_state_dict(saved["model"])
    ropt.load_state_dict(saved["optimizer"])
    for x in batches[4:]:
        assert step(original, opt, x) == step(resumed, ropt, x)
    for a, b in zip(original.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)
