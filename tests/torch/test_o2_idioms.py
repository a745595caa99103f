"""O2 idioms that write to the model, not the masters (issue 10, item 5).

Clipping the model's gradients after ``unscale_``, editing weights in place after ``wrap``
and calling a submodule on its own must do what they do in plain PyTorch.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from _torch_nets import batch, mlp  # noqa: E402
from torch import nn  # noqa: E402

import mixprec  # noqa: E402
import mixprec.torch as mpt  # noqa: E402

pytestmark = pytest.mark.torch


def _masters(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in mpt.master_params(opt)]


def _norm(tensors: list[torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.stack([t.float().norm() for t in tensors])))


def _backward(model: nn.Module, opt: torch.optim.Optimizer, step: int = 0) -> None:
    x, y = batch(step)
    opt.zero_grad()
    with mpt.scale_loss(F.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()


# ------------------------------------------------------------------ clipping model gradients


def test_clipping_the_model_gradients_after_unscale_clips_what_the_optimizer_applies() -> None:
    model = mlp()
    model, opt = mpt.wrap(model, torch.optim.SGD(model.parameters(), lr=1.0), policy="O2-bf16")
    _backward(model, opt)
    mpt.unscale_(opt)
    assert _norm([p.grad for p in mpt.master_params(opt)]) > 0.5  # so a 0.1 clip bites
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    before = _masters(opt)
    opt.step()
    moved = [b - a for b, a in zip(before, _masters(opt), strict=True)]  # lr 1: the gradient
    assert _norm(moved) == pytest.approx(0.1, rel=1e-2)
    assert _norm([p.grad for p in mpt.master_params(opt)]) == pytest.approx(0.1, rel=1e-2)


def test_a_model_gradient_clip_matches_the_master_clip_to_the_gradient_dtype() -> None:
    results = []
    for clip_model in (True, False):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model, opt = mpt.wrap(model, opt, policy="O2-bf16")
        _backward(model, opt)
        mpt.unscale_(opt)
        params = model.parameters() if clip_model else mpt.master_params(opt)
        torch.nn.utils.clip_grad_norm_(params, 0.1)
        opt.step()
        results.append(_masters(opt))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-4)


def test_unscale_without_a_clip_changes_nothing_the_step_applies() -> None:
    results = []
    for call_unscale in (True, False):
        model = mlp()
        model, opt = mpt.wrap(model, torch.optim.Adam(model.parameters()), policy="O2-bf16")
        for step in range(3):
            _backward(model, opt, step)
            if call_unscale:
                mpt.unscale_(opt)
            opt.step()
        results.append(_masters(opt))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_float16_with_loss_scaling_clips_the_unscaled_model_gradients() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)  # float16 matmuls are slow on CPUs: tiny tensors only
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt = mpt.wrap(model, opt, policy="O2", loss_scale=mixprec.DynamicScale(init=256.0))
    x, y = torch.randn(8, 4) * 10, torch.randint(0, 3, (8,))
    with mpt.scale_loss(F.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    mpt.unscale_(opt)
    true_norm = _norm([p.grad for p in mpt.master_params(opt)])
    # the model's gradients now hold the unscaled values too, so the norm a clip sees is true
    assert _norm([p.grad for p in model.parameters()]) == pytest.approx(true_norm, rel=1e-2)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    before = _masters(opt)
    opt.step()
    assert not mpt.state(opt).last_step_skipped
    moved = [b - a for b, a in zip(before, _masters(opt), strict=True)]
    assert _norm(moved) == pytest.approx(0.1, rel=1e-2)


# ------------------------------------------------------------------ weight surgery


def test_a_head_reinitialised_after_wrap_survives_the_step_at_lr_zero() -> None:
    model = mlp()
    model, opt = mpt.wrap(model, torch.optim.SGD(model.parameters(), lr=0.0), policy="O2-bf16")
    head = model[-1]
    _backward(model, opt)
    opt.step()
    with torch.no_grad():
        head.weight.copy_(torch.full_like(head.weight, 0.25))
        head.bias.zero_()
    _backward(model, opt, 1)
    opt.step()
    assert bool((head.weight == 0.25).all()) and bool((head.bias == 0).all())
    saved = model.state_dict()
    assert bool((saved["5.weight"] == 0.25).all())  # checkpoints save the edit as well


def test_an_edit_before_the_first_step_is_where_the_update_starts() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mpt.wrap(model, opt, policy="O2-bf16")
    first = model[0]
    nn.init.kaiming_normal_(first.weight)  # re-initialised in place after wrap
    edited = first.weight.detach().float().clone()
    _backward(model, opt)
    grad = first.weight.grad.detach().float().clone()
    opt.step()
    master = mpt.master_params(opt)[0]
    torch.testing.assert_close(master.detach(), edited - 0.1 * grad)
    assert torch.equal(first.weight, master.detach().to(torch.bfloat16))


def test_loading_a_checkpoint_keeps_the_exact_float32_masters() -> None:
    model = mlp()
    model, opt = mpt.wrap(model, torch.optim.Adam(model.parameters()), policy="O2-bf16")
    for step in range(2):
        _backward(model, opt, step)
        opt.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = mlp(seed=1)
    fresh, fresh_opt = mpt.wrap(
        fresh, torch.optim.SGD(fresh.parameters(), lr=0.0), policy="O2-bf16"
    )
    fresh.load_state_dict(saved)  # writes every parameter in place: not a user's edit
    _backward(fresh, fresh_opt)
    fresh_opt.step()
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, saved[key]), key


# ------------------------------------------------------------------ submodules called directly


class EncoderHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(
            nn.Sequential(nn.Linear(16, 32), nn.ReLU()), nn.Linear(32, 32), nn.ReLU()
        )
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def _linear_dtypes(module: nn.Module) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            sub.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    return seen


@pytest.mark.parametrize("policy", ["O1-bf16", "O2-bf16"])
def test_a_submodule_called_directly_runs_under_the_policy(policy: str) -> None:
    model = mpt.wrap(EncoderHead(), policy=policy)
    seen = _linear_dtypes(model)
    x = batch(0)[0]
    hidden = model.encoder(x)  # O2 used to fail with a dtype mismatch, O1 ran float32
    assert seen == [torch.bfloat16, torch.bfloat16]
    assert hidden.dtype == torch.float32  # leaves as the model's output would
    deep = model.encoder[0](x)  # a block inside a block
    assert deep.dtype == torch.float32 and seen[-1] == torch.bfloat16
    assert torch.equal(model.head(hidden), model(x))  # the same numbers as the whole forward
    assert not torch.is_autocast_enabled("cpu")


def test_gradients_flow_through_directly_called_submodules() -> None:
    model = EncoderHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mpt.wrap(model, opt, policy="O2-bf16")
    x, y = batch(0)
    loss = F.cross_entropy(model.head(model.encoder(x)), y)
    with mpt.scale_loss(loss, opt) as scaled:
        scaled.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())
    opt.step()
    assert not mpt.state(opt).last_step_skipped


def test_an_error_inside_a_directly_called_submodule_leaves_nothing_open() -> None:
    model = mpt.wrap(EncoderHead(), policy="O1-bf16")
    with pytest.raises(RuntimeError):
        model.encoder(torch.randn(4, 7))  # wrong width
    assert not torch.is_autocast_enabled("cpu")
    seen = _linear_dtypes(model)
    model.encoder(torch.randn(4, 16))  # the next direct call still enters the policy
    assert seen == [torch.bfloat16, torch.bfloat16]


# ---------------------------------------------------------------------- issue 21


@pytest.mark.parametrize("policy", ["O2-bf16", "O2"])
def test_a_float32_tensor_the_model_makes_itself_reaches_its_low_precision_layers(
    policy: str,
) -> None:
    """Lightning's demo Transformer caches ``self.pe`` (float32) in forward and builds float
    masks there; under O2 they met the bfloat16 weights: "expected m1 and m2 to have the
    same dtype"."""
    pytest.importorskip("lightning")
    from lightning.pytorch.demos.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(vocab_size=50, ninp=16, nhead=2, nhid=16, nlayers=1, dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scale = {"loss_scale": mixprec.DynamicScale(init=2.0**8)} if policy == "O2" else {}
    model, opt = mpt.wrap(model, opt, policy, **scale)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 50, (4, 8), generator=gen), torch.randint(0, 50, (4, 8), generator=gen)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = F.nll_loss(model(x, y).float(), y.view(-1))
        with mpt.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert model.pos_encoder.pe.dtype == torch.float32  # the model's own tensor, untouched
    assert not mpt.state(opt).skipped_steps and losses[-1] < losses[0]


class _Stamped(nn.Module):
    """A block fed a float32 timestep embedding its parent computes in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stamp = torch.sin(torch.arange(4, dtype=torch.float32))  # float32, made here
        hidden = torch.utils.checkpoint.checkpoint(self.block, x + stamp, use_reentrant=False)
        return self.head(hidden)


def test_a_recomputed_block_casts_as_its_forward_did() -> None:
    """Activation checkpointing recomputes the block from the float32 input it was given:
    the recomputation casts it as the forward did, so the saved tensors match."""
    torch.manual_seed(0)
    model = _Stamped()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mpt.wrap(model, opt, "O2-bf16")
    loss = model(torch.randn(3, 4)).float().sum()
    with mpt.scale_loss(loss, opt) as scaled:
        scaled.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    opt.step()
    assert not mpt.state(opt).last_step_skipped
