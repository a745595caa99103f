"""A skipped step's BatchNorm statistics, put back per model and never in place (issue 21).

The apex DCGAN loop (``wrap([netD, netG], ...)``, G's forward, D's loss overflows and D's step
is skipped, then G's backward through the kept graph) crashed at iteration 0 under O1 with
"one of the variables needed for gradient computation has been modified by an inplace
operation": D's skip restored *every* model's statistics, in place, G's included.
"""

from __future__ import annotations

import math
import warnings

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import mixprec.torch as mpt  # noqa: E402
from mixprec import DynamicScale  # noqa: E402
from mixprec.errors import MixprecWarning  # noqa: E402

pytestmark = pytest.mark.torch


def _gan(policy: str) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    netg = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 3))
    netd = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 1))
    opt_d = torch.optim.SGD(netd.parameters(), lr=0.01)
    opt_g = torch.optim.SGD(netg.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MixprecWarning)
        kw = {"loss_scale": DynamicScale(init=2.0**8)} if policy == "O1" else {}
        (netd, netg), (opt_d, opt_g) = mpt.wrap([netd, netg], [opt_d, opt_g], policy, **kw)
    return netd, netg, opt_d, opt_g


def _stats(bn: nn.Module) -> list[torch.Tensor]:
    return [bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("policy", ["O1", "O1-bf16", "O2-bf16"])
def test_the_discriminators_skip_leaves_the_generators_graph_and_statistics(policy: str) -> None:
    netd, netg, opt_d, opt_g = _gan(policy)
    real, noise = torch.randn(8, 3), torch.randn(8, 2)
    g_before = _stats(netg[1])
    d_before = _stats(netd[1])
    fake = netg(noise)  # G's forward: its statistics move, its graph is kept for errG
    g_after_forward = _stats(netg[1])
    assert not _same(g_after_forward, g_before)

    opt_d.zero_grad()
    err_d = netd(real).float().mean() - netd(fake.detach()).float().mean()
    with mpt.scale_loss(err_d * math.inf, opt_d) as scaled:  # D's loss overflows
        scaled.backward()
    opt_d.step()
    assert mpt.state(opt_d).last_step_skipped
    assert _same(_stats(netd[1]), d_before)  # D's statistics are put back...
    assert _same(_stats(netg[1]), g_after_forward)  # ...G's are G's step's business

    opt_g.zero_grad()
    err_g = -netd(fake).float().mean()
    with mpt.scale_loss(err_g, opt_g) as scaled:
        scaled.backward()  # through G's kept graph: raised "modified by an inplace operation"
    opt_g.step()
    assert not mpt.state(opt_g).last_step_skipped
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in netg.parameters())


def test_a_graph_still_needed_after_a_skip_can_run_backward() -> None:
    """One forward of D serves both losses (retain_graph); D's skipped step restores D's
    statistics while that graph still has G's backward to run."""
    netd, netg, opt_d, opt_g = _gan("O2-bf16")
    fake = netg(torch.randn(8, 2))
    before = _stats(netd[1])
    score = netd(fake).float()
    with mpt.scale_loss(score.mean() * math.nan, opt_d) as scaled:
        scaled.backward(retain_graph=True)
    opt_d.step()
    assert mpt.state(opt_d).last_step_skipped
    assert _same(_stats(netd[1]), before)
    opt_g.zero_grad()  # the NaN loss's backward reached G's gradients too
    with mpt.scale_loss(-score.mean(), opt_g) as scaled:
        scaled.backward()  # through D's saved statistics: raised before
    opt_g.step()
    assert not mpt.state(opt_g).last_step_skipped
    assert _same(_stats(netd[1]), before)


def test_each_models_statistics_follow_their_own_step() -> None:
    """Two models, two optimizers, separate backward passes: a skip of one model's step
    puts back only that model's statistics; the other's move with its taken step."""
    netd, netg, opt_d, opt_g = _gan("O1-bf16")
    netd(torch.randn(8, 3))
    fake = netg(torch.randn(8, 2))
    d_before = _stats(netd[1])
    g_moved = _stats(netg[1])
    with mpt.scale_loss(fake.float().sum() * math.inf, opt_g) as scaled:
        scaled.backward()
    opt_g.step()  # G's round: only G's statistics go back
    assert mpt.state(opt_g).last_step_skipped
    assert int(netg[1].num_batches_tracked) == 0 and not _same(_stats(netg[1]), g_moved)
    assert _same(_stats(netd[1]), d_before)  # D's forward is D's step's business
    with mpt.scale_loss(netd(torch.randn(8, 3)).float().sum(), opt_d) as scaled:
        scaled.backward()
    opt_d.step()  # D's two training forwards of this step are kept
    assert not mpt.state(opt_d).last_step_skipped
    assert int(netd[1].num_batches_tracked) == 2 and not _same(_stats(netd[1]), d_before)


def test_a_model_no_optimizer_trains_is_settled_by_every_round() -> None:
    """A frozen teacher in training mode: its statistics go back with any skipped step."""
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    teacher = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).requires_grad_(False)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    (student, teacher), opt = mpt.wrap([student, teacher], opt, "O1-bf16")
    before = _stats(teacher[1])
    x = torch.randn(8, 3)
    loss = (student(x).float() - teacher(x).float()).pow(2).mean()
    with mpt.scale_loss(loss * math.nan, opt) as scaled:
        scaled.backward()
    opt.step()
    assert mpt.state(opt).last_step_skipped
    assert _same(_stats(teacher[1]), before)
