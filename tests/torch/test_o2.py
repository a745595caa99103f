"""O2: low-precision params with float32 masters, float32 BatchNorm islands, tied weights."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from _torch_nets import mlp, train_step  # noqa: E402
from torch import nn  # noqa: E402

import mixprec  # noqa: E402
import mixprec.torch as mpt  # noqa: E402

pytestmark = pytest.mark.torch


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 8 * 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.flatten(1))


@pytest.mark.parametrize("policy", ["O2", "O2-bf16"])
def test_params_cast_batchnorm_pinned_masters_float32(policy: str) -> None:
    model = ConvNet()
    originals = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = mpt.wrap(model, opt, policy=policy)
    lowp = torch.float16 if policy == "O2" else torch.bfloat16
    for name, param in model.named_parameters():
        assert param.dtype == (torch.float32 if name.startswith("bn") else lowp), name
    assert model.bn1.running_mean.dtype == torch.float32
    masters = mpt.master_params(opt)
    assert all(m.dtype == torch.float32 for m in masters)
    # masters hold the exact float32 values from before the cast
    for (name, _), master in zip(model.named_parameters(), masters, strict=True):
        assert torch.equal(master, originals[name]), name
    out = model(torch.randn(2, 1, 8, 8))
    assert out.dtype == torch.float32  # policy.output


@pytest.mark.parametrize("policy", ["O2", "O2-bf16"])
def test_frozen_batchnorm_fine_tuning_trains_without_dtype_errors(policy: str) -> None:
    """BN params frozen (requires_grad False) and BN in eval mode while the rest trains."""
    model = ConvNet()
    for bn in (model.bn1, model.bn2):
        for p in bn.parameters():
            p.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(trainable, lr=1e-2)
    model, opt = mpt.wrap(model, opt, policy=policy)
    model.train()
    model.bn1.eval()
    model.bn2.eval()
    stats = model.bn1.running_mean.clone()
    frozen = model.bn1.weight.clone()
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 1, 8, 8, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        with mpt.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    assert torch.equal(model.bn1.running_mean, stats)  # eval BN: statistics untouched
    assert torch.equal(model.bn1.weight, frozen)
    assert model.bn1.weight.grad is None
    # and in train mode too
    model.bn1.train()
    model(x).sum().backward()


def test_batchnorm_in_train_mode_updates_float32_statistics() -> None:
    model = ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mpt.wrap(model, opt, policy="O2")
    before = model.bn1.running_mean.clone()
    train_step_input = torch.randn(8, 1, 8, 8)
    opt.zero_grad()
    loss = model(train_step_input).float().pow(2).mean()
    with mpt.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    assert model.bn1.running_mean.dtype == torch.float32
    assert not torch.equal(model.bn1.running_mean, before)


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(20, 8)
        self.mix = nn.Linear(8, 8)
        self.out = nn.Linear(8, 20, bias=False)
        self.out.weight = self.embed.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.embed(idx))))


@pytest.mark.parametrize("policy", ["O2", "O2-bf16"])
def test_tied_weights_share_one_master(policy: str) -> None:
    model = TiedLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = mpt.wrap(model, opt, policy=policy)
    masters = mpt.master_params(opt)
    assert len(masters) == 3  # the tied embed/out weight once, the mix weight and bias
    assert model.out.weight is model.embed.weight
    idx = torch.randint(0, 20, (4, 6), generator=torch.Generator().manual_seed(1))
    for _ in range(5):
        opt.zero_grad()
        loss = F.cross_entropy(model(idx).reshape(-1, 20), idx.reshape(-1))
        with mpt.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    assert model.out.weight is model.embed.weight
    master = masters[0]
    assert torch.equal(model.embed.weight, master.to(model.embed.weight.dtype))
    sd = model.state_dict()
    assert torch.equal(sd["embed.weight"], master) and torch.equal(sd["out.weight"], master)


def test_o2_model_trains_and_masters_keep_precision() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = mpt.wrap(model, opt, policy="O2")
    for step in range(5):
        train_step(model, opt, step)
    masters = mpt.master_params(opt)
    params = list(model.parameters())
    off_grid = 0
    for p, m in zip(params, masters, strict=True):
        if p.dtype == torch.float16:
            assert torch.equal(p, m.half())
            off_grid += not torch.equal(m.half().float(), m)
    assert off_grid  # tiny SGD updates live in the masters, below float16's resolution


def test_boundary_casts_inputs_and_islands_cast_back() -> None:
    seen = {}
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model[1].register_forward_hook(lambda m, a, o: seen.update(bn_in=a[0].dtype, bn_out=o.dtype))
    model[2].register_forward_hook(lambda m, a, o: seen.update(head_in=a[0].dtype))
    model = mpt.wrap(model, policy="O2-bf16")
    out = model(torch.randn(3, 4))  # float32 input, cast at the boundary
    assert seen == {"bn_in": torch.float32, "bn_out": torch.float32, "head_in": torch.bfloat16}
    assert out.dtype == torch.float32
    assert mixprec.torch.wrap is mpt.wrap


def _saved_activation_bytes(model: nn.Module, x: torch.Tensor, autocast: bool) -> int:
    """Bytes of the distinct non-parameter tensors autograd saves for one forward pass."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            F.cross_entropy(model(x).float(), torch.zeros(len(x), dtype=torch.long))
    return sum(saved.values())


def test_o2_saves_no_more_for_backward_than_autocast() -> None:
    """The boundary casts of O2 keep no float32 copy of an activation alive for backward."""
    torch.manual_seed(0)
    x = torch.randn(512, 32)

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU())

    reference = _saved_activation_bytes(model(), x, autocast=True)
    o2 = mpt.wrap(model(), policy="O2-bf16")
    # bf16 layer inputs plus the float32 log-softmax of the loss; autocast also saves its
    # bf16 weight casts, a few KiB here against 100 KiB of activations
    assert _saved_activation_bytes(o2, x, autocast=False) <= reference
