"""A complex parameter is refused by name with a fix, not "unknown dtype" (issue 37)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import mixprec.torch as mpt  # noqa: E402
from mixprec.errors import UnsupportedDtypeError  # noqa: E402


class Phase(nn.Module):
    """A real layer and a complex phase parameter (a spectral filter, as in FNO-style nets)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.filter = nn.Parameter(torch.full((4,), 1.0 + 0.5j, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * self.filter.abs().to(y.dtype)


@pytest.mark.parametrize("policy", ["O0", "O1-bf16", "O1", "O2", "O2-bf16", "O3"])
def test_a_complex_parameter_is_named_with_the_fix_before_anything_changes(policy: str) -> None:
    """Run as found: one optimizer over every parameter, wrapped."""
    model = Phase()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = type(optimizer).step
    with pytest.raises(UnsupportedDtypeError) as caught:
        mpt.wrap(model, optimizer, policy=policy)
    said = str(caught.value)
    assert "unknown dtype" not in said
    assert "filter (torch.complex64)" in said and "lin." not in said
    assert "optimizer of their own" in said and "torch.view_as_real" in said
    assert model.lin.weight.dtype == torch.float32 and model.filter.dtype == torch.complex64
    assert type(optimizer).step is step and not hasattr(model, "_mixprec")


@pytest.mark.parametrize("policy", ["O0", "O1-bf16", "O2-bf16", "O3-bf16"])
def test_the_fix_the_message_gives_trains(policy: str) -> None:
    """The complex parameter in an optimizer of its own, outside wrap, under a policy
    without loss scaling: both parts train."""
    torch.manual_seed(0)
    model = Phase()
    real = torch.optim.SGD(model.lin.parameters(), lr=0.1)
    phase = torch.optim.SGD([model.filter], lr=0.1)
    model, real = mpt.wrap(model, real, policy=policy)
    start = model.filter.detach().clone()
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        real.zero_grad()
        phase.zero_grad()
        loss = model(torch.randn(8, 4, generator=gen)).float().pow(2).mean()
        with mpt.scale_loss(loss, real) as scaled:
            scaled.backward()
        real.step()
        phase.step()
    assert bool(torch.isfinite(torch.view_as_real(model.filter)).all())
    assert not torch.equal(model.filter.detach(), start)
