"""The CUDA paths on a real GPU: skipped without one, run by ``make gpu-check``.

What the fake-CUDA tests (``test_fake_cuda.py``) cannot check runs here: values, backward,
the loss scaler's skips, the optimizer step and masters on the device, checkpoints, the
advisor's CUDA timing and memory, and whether the simulation itself agrees with the device.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from _fake_cuda import Block, cpu_flow, dtype_flow, fake_cuda, to_fake_cuda  # noqa: E402
from _torch_nets import batch, mlp  # noqa: E402
from torch import nn  # noqa: E402

import mixprec  # noqa: E402
import mixprec.torch as mpt  # noqa: E402
from mixprec.errors import UnsupportedDtypeError  # noqa: E402
from mixprec_torch.devices import cuda_capability  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.cuda]

DEV = "cuda"


def _bf16() -> bool:
    return torch.cuda.get_device_capability(0) >= (8, 0)


def cuda_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(step)
    return x.to(DEV), y.to(DEV)


def test_capabilities_list_this_gpu_by_its_compute_capability() -> None:
    major, minor = torch.cuda.get_device_capability(0)
    assert mpt.capabilities().device("cuda:0") == cuda_capability(0, major, minor)


def test_auto_resolves_for_this_gpu() -> None:
    model = mlp().to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mpt.wrap(model, opt)
    want = "O1-bf16" if _bf16() else "O1"
    assert str(mpt.state(opt).policy) == want


def test_the_simulated_device_gives_the_dtypes_of_the_real_one() -> None:
    """The fake-CUDA tests stand in for this GPU: the same wrapped model has the same dtype
    at every module on the device, under the simulation, and on the CPU."""
    policies = ["O1", "O2", "torch-autocast-cuda"] + (["O1-bf16", "O2-bf16"] if _bf16() else [])
    for policy in policies:
        torch.manual_seed(0)
        real = mpt.wrap(Block().to(DEV).train().requires_grad_(False), policy=policy)
        on_gpu = dtype_flow(real, torch.randn(2, 3, 6, 6, device=DEV))
        with fake_cuda(*torch.cuda.get_device_capability(0)):
            with torch.device("meta"):
                block = Block().train()
            simulated = dtype_flow(
                mpt.wrap(to_fake_cuda(block), policy=policy),
                torch.empty(2, 3, 6, 6, device=DEV),
            )
        assert on_gpu == simulated == cpu_flow(policy), policy


def _loop(policy: str | None, steps: int = 30) -> tuple[list[float], list[torch.Tensor], float]:
    """``steps`` fp16 steps with two injected overflows, as a mixprec loop (``policy``) or
    as autocast + GradScaler (``None``)."""
    model = mlp().to(DEV)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(DEV)
    if policy is not None:
        model, opt = mpt.wrap(model, opt, policy=policy)
    losses = []
    for step in range(steps):
        x, y = cuda_batch(step)
        opt.zero_grad()
        if policy is None:
            with torch.autocast(DEV, dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
        else:
            loss = F.cross_entropy(model(x), y)
            with mpt.scale_loss(loss, opt) as scaled:
                scaled.backward()
        if step in (5, 6):
            next(model.parameters()).grad[0, 0] = float("inf")
        if policy is None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        losses.append(loss.item())
    scale = scaler.get_scale() if policy is None else mpt.state(opt).loss_scale
    return losses, [p.detach().clone() for p in model.parameters()], scale


def test_torch_autocast_cuda_preset_matches_autocast_and_grad_scaler_exactly() -> None:
    got, want = _loop("torch-autocast-cuda"), _loop(None)
    assert got[0] == want[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))
    assert got[2] == want[2] == 2.0**16 * 0.25


@pytest.mark.parametrize(
    "policy", ["O1", "O2", "O3-bf16", "O1-bf16", "O2-bf16", "O3-bf16-kahan", "O3-bf16-sr"]
)
def test_training_on_the_gpu_learns_and_keeps_its_state_there(policy: str) -> None:
    if "bf16" in policy and not _bf16():
        pytest.skip("this GPU has no bfloat16 (compute capability < 8.0)")
    model = mlp(batchnorm=True).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = mpt.wrap(model, opt, policy=policy, seed=0)
    x, y = cuda_batch(0)
    losses = []
    for _ in range(40):
        opt.zero_grad()
        loss = F.cross_entropy(model(x).float(), y)
        with mpt.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], losses
    assert mpt.state(opt).skipped_steps <= 5  # float16's scale may back off a few times
    for master in mpt.master_params(opt):
        assert master.device.type == "cuda"
        state = [v for v in opt.state[master].values() if isinstance(v, torch.Tensor)]
        assert all(v.device.type == "cuda" for v in state if v.dim()), policy  # not `step`


@pytest.mark.parametrize("policy", ["O2", "O2-bf16", "O3-bf16-kahan"])
def test_resume_on_the_gpu_is_exact(policy: str) -> None:
    if "bf16" in policy and not _bf16():
        pytest.skip("this GPU has no bfloat16 (compute capability < 8.0)")

    def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp(batchnorm=True).to(DEV)
        return mpt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), policy=policy)

    def steps(model: nn.Module, opt: torch.optim.Optimizer, start: int, n: int) -> None:
        for step in range(start, start + n):
            x, y = cuda_batch(step)
            opt.zero_grad()
            with mpt.scale_loss(F.cross_entropy(model(x).float(), y), opt) as scaled:
                scaled.backward()
            opt.step()

    model, opt = fresh()
    steps(model, opt, 0, 3)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    steps(model, opt, 3, 3)
    again, again_opt = fresh()
    again.load_state_dict(saved["model"])
    again_opt.load_state_dict(saved["opt"])
    steps(again, again_opt, 3, 3)
    for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_bfloat16_is_refused_on_a_gpu_without_it() -> None:
    if _bf16():
        pytest.skip("this GPU computes bfloat16; test_fake_cuda.py checks the refusal")
    with pytest.raises(UnsupportedDtypeError, match=r"needs 8\.0"):
        mpt.wrap(mlp().to(DEV), policy="O1-bf16")


def test_the_advisor_times_and_measures_on_the_gpu() -> None:
    batches = [cuda_batch(step) for step in range(2)]
    report = mpt.advise(
        mlp().to(DEV),
        lambda p: torch.optim.SGD(p, lr=0.01),
        batches,
        F.cross_entropy,
        ["O1", "O2"],
        steps=4,
        progress=False,
    )
    assert "CUDA" in report.memory_measure
    for run in report.runs:
        assert run.ok, run.status
        assert run.peak_memory is not None and run.peak_memory > 0
    assert str(mixprec.get_policy(report.recommended)) == report.recommended
