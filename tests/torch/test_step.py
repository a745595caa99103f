"""The optimizer step: skipping, the loss scale, schedulers, accumulation, clipping, GANs."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from _torch_nets import batch, mlp, same, snapshot, train_step  # noqa: E402
from torch import nn  # noqa: E402

import mixprec  # noqa: E402
import mixprec.torch as mpt  # noqa: E402
from mixprec.errors import StepOrderError, WrapError  # noqa: E402

pytestmark = pytest.mark.torch

SMALL = mixprec.DynamicScale(init=2.0**10, interval=3)


def wrapped(
    policy: str = "O2", *, opt: str = "adam", **overrides: object
) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = mlp()
    if opt == "adam":
        optimizer: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return mpt.wrap(model, optimizer, policy=policy, **overrides)


@pytest.mark.parametrize("policy", ["O1", "O2", "O1-bf16", "O2-bf16"])
def test_an_inf_gradient_skips_the_step_and_backs_off(policy: str) -> None:
    model, opt = wrapped(policy, opt="sgd", loss_scale=SMALL)
    for step in range(2):
        train_step(model, opt, step)
    before = snapshot(model, opt)
    st = mpt.state(opt)
    assert (st.loss_scale, st.skipped_steps, st.last_step_skipped) == (1024.0, 0, False)

    train_step(model, opt, 2, inject_inf=True)

    assert same(snapshot(model, opt), before), "a skipped step changed weights or state"
    st = mpt.state(opt)
    assert (st.loss_scale, st.skipped_steps, st.last_step_skipped) == (512.0, 1, True)
    assert [e.kind for e in st.events] == ["skip", "backoff"]
    assert st.policy == mixprec.get_policy(policy, loss_scale=SMALL)

    # the next step runs with the new scale: its scaled loss is loss * 512
    x, y = batch(3)
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    with mpt.scale_loss(loss, opt) as scaled:
        assert scaled.dtype == torch.float32
        assert float(scaled.detach()) == float(loss.detach().float()) * 512.0
        scaled.backward()
    opt.step()
    assert not same(snapshot(model, opt)["masters"], before["masters"])
    assert mpt.state(opt).last_step_skipped is False


@pytest.mark.parametrize("policy", ["O2-bf16", "O3-bf16", "O3"])
def test_without_scaling_an_overflow_still_skips(policy: str) -> None:
    model, opt = wrapped(policy, opt="sgd")
    assert mpt.state(opt).loss_scale == 1.0
    train_step(model, opt, 0)
    before = snapshot(model, opt)
    train_step(model, opt, 1, inject_inf=True)
    assert same(snapshot(model, opt), before)
    assert mpt.state(opt).skipped_steps == 1
    assert [e.kind for e in mpt.state(opt).events] == ["skip"]


def test_growth_after_interval_finite_steps() -> None:
    model, opt = wrapped("O1", loss_scale=SMALL)
    for step in range(3):
        train_step(model, opt, step)
    assert mpt.state(opt).loss_scale == 2048.0
    assert [e.kind for e in mpt.state(opt).events] == ["growth"]


def test_lr_scheduler_counts_iterations_including_skipped_steps() -> None:
    """Documented behaviour: optimizer.step() is called every iteration, so the scheduler
    advances on skipped steps too, and never warns (pytest turns warnings into errors)."""
    model, opt = wrapped("O2", opt="sgd", loss_scale=SMALL)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    lrs = []
    for step in range(5):
        train_step(model, opt, step, inject_inf=step in (0, 3))  # the very first step skips
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert mpt.state(opt).skipped_steps == 2
    assert lrs == [0.05, 0.025, 0.025, 0.0125, 0.0125]
    assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"


def test_scheduler_built_before_wrap_still_sees_the_patched_step() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (epoch + 1))
    model, opt = mpt.wrap(model, opt, policy="O2", loss_scale=SMALL)
    before = snapshot(model, opt)
    train_step(model, opt, 0, inject_inf=True)
    assert same(snapshot(model, opt), before)  # the patched step ran (and skipped)
    sched.step()
    train_step(model, opt, 1)
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05 / 3)


def test_gradient_accumulation_over_micro_batches() -> None:
    """Four scaled micro-batch backwards then one step == one step on the summed loss."""
    torch.manual_seed(0)
    ref_model, ref_opt = wrapped("O1", opt="sgd")
    model, opt = wrapped("O1", opt="sgd")
    x, y = batch(0)
    ref_opt.zero_grad()
    loss = F.cross_entropy(ref_model(x), y, reduction="sum")
    with mpt.scale_loss(loss, ref_opt) as scaled:
        scaled.backward()
    ref_opt.step()
    opt.zero_grad()
    for xs, ys in zip(x.chunk(4), y.chunk(4), strict=True):
        micro = F.cross_entropy(model(xs), ys, reduction="sum")
        with mpt.scale_loss(micro, opt) as scaled:
            scaled.backward()
    opt.step()
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert mpt.state(opt).steps == 1


def test_unscale_before_clipping_clips_true_gradients() -> None:
    model, opt = wrapped("O2", opt="sgd")
    x, y = batch(0)
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    with mpt.scale_loss(loss, opt) as scaled:
        scaled.backward()
    scaled_norm = torch.linalg.vector_norm(
        torch.stack([p.grad.float().norm() for p in model.parameters()])
    )
    mpt.unscale_(opt)
    masters = mpt.master_params(opt)
    assert all(m.dtype == torch.float32 for m in masters)
    norm = torch.nn.utils.clip_grad_norm_(masters, 0.1)
    assert float(norm) == pytest.approx(float(scaled_norm) / 65536.0, rel=1e-2)
    clipped = torch.linalg.vector_norm(torch.stack([m.grad.norm() for m in masters]))
    assert float(clipped) == pytest.approx(0.1, rel=1e-3)
    opt.step()
    assert mpt.state(opt).steps == 1 and not mpt.state(opt).last_step_skipped


def test_zero_grad_clears_model_and_master_gradients() -> None:
    model, opt = wrapped("O2")
    train_step(model, opt, 0)
    assert all(p.grad is not None for p in model.parameters())
    opt.zero_grad(set_to_none=False)
    assert all(float(p.grad.abs().sum()) == 0 for p in model.parameters())
    assert all(float(m.grad.abs().sum()) == 0 for m in mpt.master_params(opt))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert all(m.grad is None for m in mpt.master_params(opt))


# ------------------------------------------------------------------------------ a GAN loop


def gan(policy: str) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    disc = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    (gen, disc), (opt_g, opt_d) = mpt.wrap(
        [gen, disc], [opt_g, opt_d], policy=policy, loss_scale=SMALL
    )
    return gen, disc, opt_g, opt_d


def test_gan_loop_two_models_two_optimizers_one_scaler() -> None:
    gen, disc, opt_g, opt_d = gan("O2")
    real = torch.randn(32, 8) + 2.0
    for _ in range(3):
        z = torch.randn(32, 4)
        opt_d.zero_grad()
        fake = gen(z).detach()
        d_loss = F.binary_cross_entropy_with_logits(
            disc(real), torch.ones(32, 1)
        ) + F.binary_cross_entropy_with_logits(disc(fake), torch.zeros(32, 1))
        with mpt.scale_loss(d_loss, opt_d) as scaled:
            scaled.backward()
        opt_d.step()
        opt_g.zero_grad()
        g_loss = F.binary_cross_entropy_with_logits(disc(gen(z)), torch.ones(32, 1))
        with mpt.scale_loss(g_loss, opt_g) as scaled:
            scaled.backward()
        opt_g.step()
    assert mpt.state(opt_g).steps == mpt.state(opt_d).steps == 6  # one shared scaler, 2 rounds/iter
    assert mpt.state(opt_g).events is mpt.state(opt_d).events


def test_optimizers_of_one_backward_skip_together() -> None:
    gen, disc, opt_g, opt_d = gan("O2")
    z = torch.randn(8, 4)
    before = (snapshot(gen, opt_g), snapshot(disc, opt_d))
    opt_g.zero_grad()
    opt_d.zero_grad()
    loss = disc(gen(z)).mean()
    with mpt.scale_loss(loss, [opt_g, opt_d]) as scaled:
        scaled.backward()
    next(iter(gen.parameters())).grad.view(-1)[0] = float("nan")  # only the generator overflows
    opt_d.step()  # decides for both: the discriminator skips too
    opt_g.step()
    assert same((snapshot(gen, opt_g), snapshot(disc, opt_d)), before)
    assert mpt.state(opt_d).skipped_steps == 1 and mpt.state(opt_d).steps == 1
    assert mpt.state(opt_d).loss_scale == 512.0


def test_scale_loss_refuses_optimizers_from_different_wrap_calls() -> None:
    _, opt_a = wrapped("O1")
    _, opt_b = wrapped("O1")
    loss = torch.ones((), requires_grad=True)
    with (
        pytest.raises(WrapError, match="different wrap calls"),
        mpt.scale_loss(loss, [opt_a, opt_b]),
    ):
        pass


# --------------------------------------------------------------------------- step order


def test_step_without_backward_says_what_is_missing() -> None:
    model, opt = wrapped("O2")
    with pytest.raises(StepOrderError, match="scale_loss"):
        opt.step()
    train_step(model, opt, 0)
    with pytest.raises(StepOrderError, match="no backward pass through scale_loss since the last"):
        opt.step()


def test_unscale_twice_and_backward_after_unscale_are_refused() -> None:
    model, opt = wrapped("O2")
    x, y = batch(0)
    loss = F.cross_entropy(model(x), y)
    with mpt.scale_loss(loss, opt) as scaled:
        scaled.backward(retain_graph=True)
    mpt.unscale_(opt)
    with pytest.raises(StepOrderError, match="already been called"):
        mpt.unscale_(opt)
    with pytest.raises(StepOrderError, match="after unscale_"), mpt.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()  # the refused calls left the iteration intact
    assert mpt.state(opt).steps == 1


def test_closures_are_refused() -> None:
    model, opt = wrapped("O1")
    train_step_loss = F.cross_entropy(model(batch(0)[0]), batch(0)[1])
    with mpt.scale_loss(train_step_loss, opt) as scaled:
        scaled.backward()
    with pytest.raises(StepOrderError, match="closure"):
        opt.step(lambda: 0.0)


def test_unwrapped_optimizer_gets_an_actionable_error() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(WrapError, match="wrap it first"):
        mpt.state(opt)
    with pytest.raises(WrapError, match="wrap it first"), mpt.scale_loss(torch.ones(()), opt):
        pass


def test_unscale_of_a_round_member_after_the_first_step_does_not_unscale_twice() -> None:
    """``scale_loss(loss, [opt_a, opt_b])``: opt_a's step opens the round, which unscales
    opt_b's gradients too; an ``unscale_(opt_b)`` (to clip) must then leave them as they
    are, and opt_b's own step applies them once."""
    torch.manual_seed(0)
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b)]
    (a, b), (opt_a, opt_b) = mpt.wrap([a, b], opts, "O2", loss_scale="static:1024")
    x = torch.randn(4, 3)
    with mpt.scale_loss((a(x).float() + b(x).float()).sum(), [opt_a, opt_b]) as scaled:
        scaled.backward()
    want = x.sum(0).expand(2, 3)  # d(sum of b(x))/d(b.weight): the unscaled gradient
    opt_a.step()
    mpt.unscale_(opt_b)
    grad = mpt.master_params(opt_b)[0].grad
    torch.testing.assert_close(grad, want, rtol=1e-3, atol=1e-3)
    before = mpt.master_params(opt_b)[0].detach().clone()
    opt_b.step()
    torch.testing.assert_close(
        mpt.master_params(opt_b)[0], before - 0.1 * want, rtol=1e-3, atol=1e-3
    )
    assert mpt.state(opt_b).skipped_steps == 0
