"""Lightning Fabric: MixprecPrecision is refused naming the recipe, and the recipe (wrap
before ``fabric.setup``) trains exactly as the plain mixprec loop does (issue 21)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

from _lightning_nets import LIGHTNING_MARKS  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from torch import nn  # noqa: E402

import mixprec.torch as mpt  # noqa: E402
from mixprec.errors import WrapError  # noqa: E402
from mixprec.lightning import MixprecPrecision  # noqa: E402

pytestmark = LIGHTNING_MARKS


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_fabric_with_the_plugin_is_refused_with_the_recipe() -> None:
    """It failed deep inside with AttributeError: 'NoneType' object has no attribute 'trainer'."""
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixprecPrecision("O2-bf16")])
    model, opt = _model_and_optimizer()
    with pytest.raises(WrapError, match=r"Fabric.*mixprec\.torch\.wrap\(model, optimizer"):
        fabric.setup(model, opt)
    assert model[0].weight.dtype == torch.float32  # nothing was converted


def _train(policy: str, fabric: Fabric | None) -> list[torch.Tensor]:
    model, opt = mpt.wrap(*_model_and_optimizer(), policy)
    if fabric is not None:
        model, opt = fabric.setup(model, opt)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 3, (16,), generator=gen)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x).float(), y)
        with mpt.scale_loss(loss, opt) as scaled:
            fabric.backward(scaled) if fabric is not None else scaled.backward()
        mpt.unscale_(opt)
        if fabric is not None:  # clips what the optimizer updates: the float32 masters
            fabric.clip_gradients(model, opt, max_norm=0.5)
        else:
            torch.nn.utils.clip_grad_norm_(mpt.master_params(opt), 0.5)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("policy", ["O2-bf16", "O2", "O1-bf16"])
def test_the_wrap_before_setup_recipe_trains_as_the_plain_loop(policy: str) -> None:
    plain = _train(policy, None)
    with_fabric = _train(policy, Fabric(accelerator="cpu", devices=1))
    assert all(torch.equal(a, b) for a, b in zip(plain, with_fabric, strict=True))
