"""The torch-autocast presets reproduce torch.autocast + torch.amp.GradScaler exactly."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from _torch_nets import batch, mlp  # noqa: E402

import mixprec  # noqa: E402
import mixprec.torch as mpt  # noqa: E402
from mixprec_torch.dtypes import torch_dtype  # noqa: E402
from mixprec_torch.o1.autocast import intercepted_ops  # noqa: E402
from mixprec_torch.o1.probes import autocast_dtypes  # noqa: E402
from mixprec_torch.presets import torch_autocast_policy  # noqa: E402

pytestmark = pytest.mark.torch

STEPS = 30
INF_STEPS = (5, 6)  # two overflows: both loops must skip them and back off the same way


def inject_inf(model: torch.nn.Module, step: int) -> None:
    if step in INF_STEPS:
        next(model.parameters()).grad[0, 0] = float("inf")


def reference(dtype: torch.dtype) -> tuple[list[float], list[torch.Tensor], float]:
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        inject_inf(model, step)
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()], scaler.get_scale()


def ours(policy: mixprec.Policy) -> tuple[list[float], list[torch.Tensor], float]:
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = mpt.wrap(model, opt, policy=policy)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        with mpt.scale_loss(loss, opt) as scaled:
            scaled.backward()
        inject_inf(model, step)
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()], mpt.state(opt).loss_scale


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_matches_torch_autocast_and_grad_scaler_exactly(dtype: str) -> None:
    """float16 exercises a real dynamic scaler on CPU (GradScaler's defaults); bfloat16 is CPU
    autocast's own default dtype. Both losses and weights are bit-identical for 30 steps, two of
    them overflowing on purpose."""
    policy = mixprec.get_policy("torch-autocast-cpu", compute=dtype)
    assert policy.loss_scale == mixprec.DynamicScale(skip="optimizer")  # GradScaler's defaults
    got = ours(policy)  # first: loading plugins may change torch's thread count
    want = reference(torch_dtype(dtype))
    assert got[0] == want[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))
    assert got[2] == want[2] == 2.0**16 * 0.5 ** len(INF_STEPS)


def test_the_preset_intercepts_nothing_autocast_already_does() -> None:
    for dtype in ("bfloat16", "float16"):
        policy = mixprec.get_policy("torch-autocast-cpu", compute=dtype)
        # rnn_cell: autocast casts torch.lstm but not torch.gru_cell (documented); cat and
        # stack: CPU autocast's promote rule raises for the *other* low-precision dtype
        # (float16 inputs under bfloat16 autocast), so the policy's promote rule takes over
        assert intercepted_ops(policy, ["cpu"]) <= {"rnn_cell", "cat", "stack"}


def test_cpu_table_matches_what_cpu_autocast_does() -> None:
    policy = torch_autocast_policy("cpu")
    for dtype in (torch.bfloat16, torch.float16):
        for (family, _, inputs), produced in autocast_dtypes("cpu", dtype, dtype).items():
            if produced is None or family == "rnn_cell":  # see the module docstring
                continue
            rules = mixprec.get_policy(policy, compute=str(dtype).removeprefix("torch."))
            assert rules.decide(family, inputs).dtype == produced, (family, inputs)


def test_presets_are_registered_by_the_plugin() -> None:
    names = mixprec.preset_names()
    assert {"torch-autocast", "torch-autocast-cpu", "torch-autocast-cuda"} <= set(names)
    assert mixprec.get_policy("torch-autocast-cuda").compute == "float16"
    assert mixprec.get_policy("torch-autocast-cpu").modules == ()


@pytest.mark.cuda
def test_cuda_table_matches_what_cuda_autocast_does() -> None:
    policy = torch_autocast_policy("cuda")
    for (family, _, inputs), produced in autocast_dtypes(
        "cuda", torch.float16, torch.float16
    ).items():
        if produced is None:
            continue
        assert policy.decide(family, inputs).dtype == produced, (family, inputs)


def _two_heads() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)


def _two_optimizer_run(use_grad_scaler: bool) -> tuple[list[torch.Tensor], list[float]]:
    """Two models, two optimizers, one backward; only model a's gradient overflows at step 2."""
    a, b = _two_heads()
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    if not use_grad_scaler:
        (a, b), (opt_a, opt_b) = mpt.wrap([a, b], [opt_a, opt_b], policy="torch-autocast-cpu")
    scales = []
    for step in range(4):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        opt_a.zero_grad()
        opt_b.zero_grad()
        if use_grad_scaler:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = (a(x) - b(x)).float().pow(2).mean()
            scaler.scale(loss).backward()
        else:
            loss = (a(x) - b(x)).float().pow(2).mean()
            with mpt.scale_loss(loss, [opt_a, opt_b]) as scaled:
                scaled.backward()
        if step == 2:
            a.weight.grad[0, 0] = float("inf")
        if use_grad_scaler:
            scaler.step(opt_a)
            scaler.step(opt_b)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            opt_a.step()
            opt_b.step()
            scales.append(mpt.state(opt_a).loss_scale)
    return [p.detach().clone() for p in (*a.parameters(), *b.parameters())], scales


def test_several_optimizers_skip_each_on_its_own_overflow_like_grad_scaler() -> None:
    """GradScaler skips only the optimizer whose gradients overflowed and backs the scale off
    once; the torch-autocast presets (DynamicScale(skip="optimizer")) do the same."""
    want_params, want_scales = _two_optimizer_run(use_grad_scaler=True)
    got_params, got_scales = _two_optimizer_run(use_grad_scaler=False)
    assert got_scales == want_scales == [65536.0, 65536.0, 32768.0, 32768.0]
    for got, want in zip(got_params, want_params, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_default_group_skip_skips_every_optimizer_of_the_round() -> None:
    a, b = _two_heads()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b)]
    (a, b), (opt_a, opt_b) = mpt.wrap([a, b], opts, policy="O1-bf16", loss_scale="dynamic")
    before = b.weight.detach().clone()
    loss = (a(torch.ones(2, 8)) + b(torch.ones(2, 8))).float().sum()
    with mpt.scale_loss(loss, [opt_a, opt_b]) as scaled:
        scaled.backward()
    a.weight.grad[0, 0] = float("inf")
    opt_a.step()
    opt_b.step()
    assert torch.equal(b.weight, before)  # b's finite gradients were skipped too
    assert mpt.state(opt_b).skipped_steps == 1
