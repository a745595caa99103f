"""apex-style code through ``from mixprec.compat import apex_amp as amp``: the rest of amp's
API (add_param_group, a weight used twice, RNNs, registered and disabled functions, the
migration example, LARC-style optimizer wrappers, a real float16 overflow).
"""

from __future__ import annotations

import copy
import runpy
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from _apex_nets import (  # noqa: E402
    data,
    fresh_registry,  # noqa: F401 (its autouse fixture)
    net,
)
from torch import nn  # noqa: E402

from mixprec.compat import apex_amp as amp  # noqa: E402
from mixprec.errors import PolicyError  # noqa: E402

pytestmark = pytest.mark.torch
ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ the rest of amp's API


def test_add_param_group_trains_the_added_parameters() -> None:
    model = net()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2-bf16", verbosity=0)
    opt.add_param_group({"params": model[2].parameters(), "lr": 0.1})
    before = model[2].weight.detach().clone()
    with amp.scale_loss(model(data(0)).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not torch.equal(model[2].weight, before)


class _Twice(nn.Module):
    """One weight used twice in a forward: apex's weight-cast cache casts it once."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(4, 4) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = nn.functional.linear(x, self.weight).tanh()
        return nn.functional.linear(hidden, self.weight)


def _reference(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """_Twice's forward by hand, each matmul in bfloat16 on the current weight."""
    low = weight.detach().to(torch.bfloat16)
    hidden = nn.functional.linear(x.to(torch.bfloat16), low).tanh()
    return nn.functional.linear(hidden, low).float()


def test_weight_used_twice_under_o1_gets_the_fp32_gradient_and_no_stale_cast() -> None:
    reference = _Twice()
    model = copy.deepcopy(reference)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = amp.initialize(model, opt, opt_level="O1-bf16", verbosity=0)
    for step in range(3):
        x = data(step)
        opt.zero_grad()
        out = model(x)
        assert out.dtype == torch.float32
        # both uses read the bfloat16 cast of the weight as it is now, not an older one
        assert torch.equal(out, _reference(model.weight, x))
        with amp.scale_loss(out.pow(2).mean(), opt) as scaled:
            scaled.backward()
        assert model.weight.grad is not None and model.weight.grad.dtype == torch.float32
        reference.weight.data.copy_(model.weight.detach())
        reference.weight.grad = None
        reference(x).pow(2).mean().backward()  # float32: both uses' gradients summed
        want = reference.weight.grad
        assert want is not None
        assert torch.allclose(model.weight.grad, want, rtol=0.05, atol=0.02 * want.abs().max())
        before = model.weight.detach().clone()
        opt.step()
        assert not torch.equal(model.weight, before)


def test_rnn_trains_under_o1() -> None:
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 8, batch_first=True)
    opt = torch.optim.SGD(lstm.parameters(), lr=0.5)
    lstm, opt = amp.initialize(lstm, opt, opt_level="O1-bf16", verbosity=0)
    x = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = lstm(x)[0].float().pow(2).mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


class _Calls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: dict[str, torch.dtype] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen["functional"] = nn.functional.linear(x, self.lin.weight).dtype
        self.seen["decorated"] = _doubled(x).dtype
        with amp.disable_casts():
            self.seen["disabled"] = self.lin(x).dtype
        return self.lin(x)


@amp.half_function
def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_registered_and_decorated_functions_and_disable_casts() -> None:
    amp.register_float_function(torch.nn.functional, "linear")
    model = amp.initialize(_Calls(), opt_level="O1-bf16", verbosity=0)
    model(torch.randn(2, 4))
    assert model.seen == {
        "functional": torch.float32,  # registered float: beats O1's lowp linear
        "decorated": torch.bfloat16,  # half_function: the compute dtype
        "disabled": torch.float32,  # disable_casts: the float32 weights as they are
    }
    with pytest.raises(PolicyError, match="no function"):
        amp.register_half_function(torch.nn.functional, "no_such_function")


def test_the_apex_migration_example_trains_on_digits() -> None:
    pytest.importorskip("sklearn")
    runpy.run_path(str(ROOT / "examples/apex_migration.py"), run_name="__main__")


class Larc:
    """apex's LARC shape (not a torch Optimizer): it keeps the optimizer as ``.optim`` and
    clips each gradient by a trust ratio before the optimizer's step."""

    def __init__(self, optimizer: torch.optim.Optimizer, trust: float = 0.02) -> None:
        self.optim = optimizer
        self.trust = trust

    @property
    def param_groups(self) -> list[dict]:
        return self.optim.param_groups

    def zero_grad(self) -> None:
        self.optim.zero_grad()

    def step(self) -> None:
        with torch.no_grad():
            for group in self.optim.param_groups:
                for p in group["params"]:
                    ratio = self.trust * p.norm() / (p.grad.norm() + 1e-8)
                    p.grad.mul_(torch.clamp(ratio, max=1.0))
        self.optim.step()


def _larc_run(shim: bool) -> list[torch.Tensor]:
    model = net()
    larc = Larc(torch.optim.SGD(model.parameters(), lr=0.5))
    if shim:
        model, got = amp.initialize(model, larc, opt_level="O0", loss_scale="dynamic", verbosity=0)
        assert got is larc
    for step in range(4):
        larc.zero_grad()
        loss = model(data(step)).pow(2).mean()
        if shim:
            with amp.scale_loss(loss, larc) as scaled:
                scaled.backward()
        else:
            loss.backward()
        larc.step()
    return [p.detach().clone() for p in model.parameters()]


def test_larc_sees_unscaled_gradients() -> None:
    """The trust ratio depends on the gradient's norm: a scaled gradient would change it."""
    for got, want in zip(_larc_run(shim=True), _larc_run(shim=False), strict=True):
        torch.testing.assert_close(got, want)


def test_o2_float16_backs_off_from_a_real_overflow_then_trains() -> None:
    """Tiny float16 model: at 2**24 the scaled float16 gradients overflow for real; the scale
    backs off until they fit, those steps skip, and the float32 masters stay finite."""
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", verbosity=0)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0**24, "unskipped": 0}})
    for step in range(14):
        opt.zero_grad()
        loss = model(data(step).half()).float().pow(2).mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    scaler = amp.loss_scalers()[0]
    assert scaler.skipped_steps >= 1 and scaler.scale < 2.0**24
    assert scaler.steps - scaler.skipped_steps >= 1
    assert all(torch.isfinite(p).all() for p in amp.master_params(opt))
    assert model.weight.dtype == torch.float16
