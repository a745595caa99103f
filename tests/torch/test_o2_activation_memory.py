"""O2-bf16 on an activation-heavy block (issue 34, item 4): what autograd saves for backward,
and the numerics any change to it must keep.

The memory benchmark's model is 6 × (Linear 512→512 + GELU) on a batch of 8192; these tests
run the same shape of block, small. What they pin is independent of the CPU: the dtypes and
bytes autograd saves (counted with ``saved_tensors_hooks``), and losses and weights
bit-identical to a hand-written O2 (bfloat16 model, float32 masters, AdamW on the masters).
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import mixprec.torch as mpt  # noqa: E402

pytestmark = pytest.mark.torch

WIDTH, DEPTH, BATCH = 32, 3, 256


def block(seed: int = 0) -> nn.Module:
    """The benchmark's model, small: DEPTH × (Linear WIDTH→WIDTH + GELU)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    return nn.Sequential(*layers)


def wrapped_o2() -> nn.Module:
    """:func:`block` wrapped for training under O2-bf16 (masters and all), its optimizer
    dropped: the forward is what is looked at."""
    model = block()
    return mpt.wrap(model, torch.optim.AdamW(model.parameters()), policy="O2-bf16")[0]


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, WIDTH, generator=gen)
    return x, torch.randint(0, WIDTH, (BATCH,), generator=gen)


# ------------------------------------------------------------------ saved for backward


def saved_for_backward(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, autocast: bool = False
) -> dict[int, tuple[torch.dtype, int, str]]:
    """storage -> (dtype, bytes, what) of every distinct floating tensor (scalars aside)
    autograd saves in one forward and loss; ``what`` is ``param`` (a parameter of the
    model), ``input`` (the caller's batch itself) or ``made`` (a tensor made in the forward:
    a cast, an activation)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, tuple[torch.dtype, int, str]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or not t.is_floating_point():  # nll_loss's total weight, the labels
            return t
        storage = t.untyped_storage()
        key = storage.data_ptr()
        what = "param" if key in params else "input" if key == x.data_ptr() else "made"
        saved[key] = (t.dtype, storage.nbytes(), what)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            F.cross_entropy(model(x).float(), y)
    return saved


def _bytes(saved: dict[int, tuple[torch.dtype, int, str]], **match: object) -> int:
    return sum(
        n
        for dtype, n, what in saved.values()
        if match.get("dtype", dtype) == dtype and match.get("what", what) == what
    )


def test_o2_bf16_saves_only_bfloat16_inside_the_model() -> None:
    """Inside the model nothing float32 is saved for backward: the input's bfloat16 cast and
    the bfloat16 activations (and the bfloat16 parameters themselves). The one float32 tensor
    saved is the loss's log-softmax, outside the model, as under autocast and float32."""
    x, y = data(0)
    saved = saved_for_backward(wrapped_o2(), x, y)
    float32 = [(n, what) for dtype, n, what in saved.values() if dtype == torch.float32]
    assert float32 == [(BATCH * WIDTH * 4, "made")]  # log_softmax's output, for its backward
    assert _bytes(saved, what="input") == 0  # the float32 batch itself is not kept
    assert {dtype for dtype, _, what in saved.values() if what == "param"} == {torch.bfloat16}
    # the input's cast and DEPTH linear and DEPTH - 1 GELU outputs, all bfloat16
    assert _bytes(saved, dtype=torch.bfloat16, what="made") == 2 * DEPTH * BATCH * WIDTH * 2


def test_o2_bf16_saves_half_the_activation_bytes_of_float32_and_no_more_than_autocast() -> None:
    x, y = data(0)
    fp32 = saved_for_backward(block(), x, y)
    o2 = saved_for_backward(wrapped_o2(), x, y)
    autocast = saved_for_backward(block(), x, y, autocast=True)
    loss = BATCH * WIDTH * 4  # the float32 log-softmax each of them saves
    # float32 saves the caller's batch itself (no copy) and float32 activations
    fp32_activations = _bytes(fp32, what="made") + _bytes(fp32, what="input") - loss
    o2_activations = _bytes(o2, what="made") - loss
    assert 2 * o2_activations == fp32_activations
    # autocast saves the same bfloat16 activations and, besides, its bfloat16 weight casts
    assert _bytes(o2, what="made") <= _bytes(autocast, what="made")


# ------------------------------------------------------------------ numerics


def reference_o2(
    steps: int, kernel: dict[str, bool | None], lr: float = 1e-2
) -> tuple[list[float], list[torch.Tensor]]:
    """O2-bf16 by hand: a bfloat16 copy of the model runs forward and backward on the
    bfloat16 cast of the batch, its gradients (widened exactly) drive AdamW on float32
    masters (with the ``kernel`` options wrap chose: fused, foreach), and the masters are
    rounded into the bfloat16 weights after each step."""
    fp32 = block()
    model = copy.deepcopy(fp32).to(torch.bfloat16)
    masters = [p.detach().clone() for p in fp32.parameters()]
    for m in masters:
        m.requires_grad_(True)
    opt = torch.optim.AdamW(masters, lr=lr, **kernel)
    losses = []
    for step in range(steps):
        x, y = data(step)
        for p in model.parameters():
            p.grad = None
        loss = F.cross_entropy(model(x.to(torch.bfloat16)).float(), y)
        loss.backward()
        for m, p in zip(masters, model.parameters(), strict=True):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters(), strict=True):
                p.copy_(m)
        losses.append(loss.item())
    return losses, masters


def mixprec_o2(
    steps: int, lr: float = 1e-2
) -> tuple[list[float], list[torch.Tensor], nn.Module, dict[str, bool | None]]:
    """The same steps through ``mpt.wrap(policy="O2-bf16")``, written as the benchmark's;
    also the AdamW kernel options the wrapped optimizer ran with."""
    model = block()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model, opt = mpt.wrap(model, opt, policy="O2-bf16")
    losses = []
    for step in range(steps):
        x, y = data(step)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).float(), y)
        with mpt.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    group = opt.param_groups[0]
    kernel = {"fused": group["fused"], "foreach": group["foreach"]}
    return losses, list(mpt.master_params(opt)), model, kernel


def test_o2_bf16_losses_and_weights_are_bit_identical_to_o2_by_hand() -> None:
    """Pins O2-bf16's numerics: whatever changes what is saved for backward must keep these
    bits (a cast saved or recomputed, a copy dropped). The optimizer's kernel is wrap's
    choice (not this test's subject), so the reference runs the one wrap chose."""
    steps = 4
    losses, masters, model, kernel = mixprec_o2(steps)
    want_losses, want_masters = reference_o2(steps, kernel)
    assert losses == want_losses
    assert len(set(losses)) == steps  # it trained: every step saw other weights or data
    for got, want in zip(masters, want_masters, strict=True):
        assert got.dtype == torch.float32
        assert torch.equal(got, want)
    for param, master in zip(model.parameters(), want_masters, strict=True):
        assert param.dtype == torch.bfloat16
        assert torch.equal(param, master.to(torch.bfloat16))
