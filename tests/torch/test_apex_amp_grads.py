"""The apex drop-in's float32 master gradients: cleared as apex cleared them (issue 21).

apex's examples zero through the model (``netD.zero_grad()``), which cannot reach the float32
master gradients; apex cleared those after every step, taken or skipped. The shim once kept
them: a skipped step's inf was added back into the next step's gradients (a weight became
``-inf`` under O2), and under O2-bf16 every step applied the sum of all earlier gradients.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")

from _apex_nets import fresh_registry  # noqa: E402,F401 (its autouse fixture)
from torch import nn  # noqa: E402

from mixprec.compat import apex_amp as amp  # noqa: E402
from mixprec.errors import PolicyError  # noqa: E402

pytestmark = pytest.mark.torch

Zero = Callable[[nn.Module, torch.optim.Optimizer], None]


def _model_zero_grad(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model.zero_grad()


def _model_zero_grad_keep(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model.zero_grad(set_to_none=False)


def _opt_zero_grad(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()


def _opt_zero_grad_keep(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad(set_to_none=False)


def _grad_none(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for param in model.parameters():
        param.grad = None


ZEROS = [_model_zero_grad, _model_zero_grad_keep, _opt_zero_grad, _opt_zero_grad_keep, _grad_none]


def _run(opt_level: str, zero: Zero, steps: int) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
    """The issue's loop: Linear(4, 1), zero, scale_loss(sum of the outputs), step. The weight
    gradient of every step is exactly 2 (two rows of ones), so each taken step moves the
    float32 master by exactly -0.1 * 2."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 1, bias=False)
    start = lin.weight.detach().clone()
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    lin, opt = amp.initialize(lin, opt, opt_level=opt_level, verbosity=0)
    dtype = lin.weight.dtype
    skipped = []
    for _ in range(steps):
        zero(lin, opt)
        with amp.scale_loss(lin(torch.ones(2, 4, dtype=dtype)).float().sum(), opt) as scaled:
            scaled.backward()
        opt.step()
        skipped.append(amp.loss_scalers()[0].last_step_skipped)
    return start, next(iter(amp.master_params(opt))).detach().clone(), skipped


def _expected(start: torch.Tensor, taken: int) -> torch.Tensor:
    """What plain float32 SGD gives after ``taken`` steps of gradient 2."""
    weight = start.clone()
    for _ in range(taken):
        weight.add_(torch.full_like(weight, 2.0), alpha=-0.1)
    return weight


@pytest.mark.parametrize("zero", ZEROS, ids=lambda z: z.__name__.strip("_"))
def test_o2_skipped_steps_leave_no_inf_for_the_next_step(zero: Zero) -> None:
    # scale 65536 and 32768 overflow float16 (gradients 131072, 65536), 16384 does not
    start, master, skipped = _run("O2", zero, steps=4)
    assert skipped == [True, True, False, False]
    assert torch.equal(master, _expected(start, taken=2))


@pytest.mark.parametrize("zero", ZEROS, ids=lambda z: z.__name__.strip("_"))
def test_o2_bf16_master_gradients_do_not_add_up_across_steps(zero: Zero) -> None:
    start, master, skipped = _run("O2-bf16", zero, steps=3)
    assert skipped == [False, False, False]
    assert torch.equal(master, _expected(start, taken=3))


def test_a_generator_loss_through_the_discriminator_never_reaches_its_step() -> None:
    """The DCGAN loop: errG's backward runs through netD (its optimizer is not in that
    scale_loss), and the next iteration zeroes netD; netD's step applies only its own
    losses' gradients."""
    torch.manual_seed(0)
    netd, netg = nn.Linear(3, 1, bias=False), nn.Linear(2, 3, bias=False)
    opt_d = torch.optim.SGD(netd.parameters(), lr=0.1)
    opt_g = torch.optim.SGD(netg.parameters(), lr=0.1)
    (netd, netg), (opt_d, opt_g) = amp.initialize(
        [netd, netg], [opt_d, opt_g], opt_level="O2-bf16", num_losses=2, verbosity=0
    )
    real = torch.ones(4, 3, dtype=torch.bfloat16)
    for _ in range(3):
        netd.zero_grad()
        with amp.scale_loss(netd(real).float().sum(), opt_d, loss_id=0) as scaled:
            scaled.backward()
        before = next(iter(amp.master_params(opt_d))).detach().clone()
        opt_d.step()
        after = next(iter(amp.master_params(opt_d))).detach().clone()
        # the discriminator's gradient is the sum of the real rows: exactly 4 per weight
        assert torch.equal(after, before.add(torch.full_like(before, 4.0), alpha=-0.1))
        netg.zero_grad()
        fake = netg(torch.ones(4, 2, dtype=torch.bfloat16))
        with amp.scale_loss(netd(fake).float().sum(), opt_g, loss_id=1) as scaled:
            scaled.backward()  # also leaves gradients in netd's weights, as in apex
        opt_g.step()


@pytest.mark.parametrize("given", ["128.0", "128", "dynamic", 128.0])
def test_loss_scale_given_as_a_string_number_is_taken_as_apex_took_it(given: object) -> None:
    """apex's ImageNet example passes ``args.loss_scale`` from argparse: a string."""
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        amp.initialize(model, opt, opt_level="O2", loss_scale=given, verbosity=0)
    expected = 65536.0 if given == "dynamic" else 128.0
    assert amp.loss_scalers()[0].scale == expected


@pytest.mark.parametrize("given", ["lots", "nan", "-1", "inf", True, [128]])
def test_a_loss_scale_that_is_no_number_is_refused_naming_the_forms(given: object) -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(PolicyError, match="loss_scale"):
        amp.initialize(model, opt, opt_level="O2", loss_scale=given, verbosity=0)
    assert model.weight.dtype == torch.float32  # refused before anything changed


def test_the_dcgan_loop_survives_a_skipped_discriminator_step_under_o1() -> None:
    """apex's DCGAN example with one changed import crashed at iteration 0 under its default
    O1: D's skipped step restored G's BatchNorm statistics in place, under G's kept graph."""
    torch.manual_seed(0)
    netg = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 3))
    netd = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 1))
    opt_d = torch.optim.Adam(netd.parameters(), lr=1e-3)
    opt_g = torch.optim.Adam(netg.parameters(), lr=1e-3)
    (netd, netg), (opt_d, opt_g) = amp.initialize(
        [netd, netg], [opt_d, opt_g], opt_level="O1", num_losses=3, verbosity=0
    )
    criterion = nn.BCEWithLogitsLoss()
    for iteration in range(2):
        real, noise = torch.randn(8, 3), torch.randn(8, 2)
        netd.zero_grad()
        err_real = criterion(netd(real).float(), torch.ones(8, 1))
        if iteration == 0:
            err_real = err_real * float("inf")  # D's step is skipped
        with amp.scale_loss(err_real, opt_d, loss_id=0) as scaled:
            scaled.backward()
        fake = netg(noise)
        g_stats = netg[1].running_mean.clone()
        err_fake = criterion(netd(fake.detach()).float(), torch.zeros(8, 1))
        with amp.scale_loss(err_fake, opt_d, loss_id=1) as scaled:
            scaled.backward()
        opt_d.step()
        assert torch.equal(netg[1].running_mean, g_stats)  # D's skip leaves G's statistics
        netg.zero_grad()
        err_g = criterion(netd(fake).float(), torch.ones(8, 1))
        with amp.scale_loss(err_g, opt_g, loss_id=2) as scaled:
            scaled.backward()  # through G's kept graph
        opt_g.step()
    assert [s.skipped_steps for s in amp.loss_scalers()] == [1, 0, 0]
    assert all(torch.isfinite(p).all() for p in [*netd.parameters(), *netg.parameters()])
