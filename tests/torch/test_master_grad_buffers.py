"""O2's float32 master gradients and ``optimizer.zero_grad()`` (``set_to_none=True``).

The loop users write by default drops every ``.grad``; under O2 the masters' float32
gradient memory is kept and reused by the next step's cast instead of being allocated (and
page-faulted in) again. What a user can see must not change: the gradients are None after
``zero_grad()``, training is bit for bit what ``set_to_none=False`` gives, and a gradient
tensor the user kept is never written.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from _torch_nets import batch, mlp, same, snapshot  # noqa: E402

import mixprec.torch as mpt  # noqa: E402

pytestmark = pytest.mark.torch


def _wrapped(policy: str = "O2-bf16", opt_cls: Any = torch.optim.AdamW) -> tuple[Any, Any]:
    model = mlp()
    opt = opt_cls(model.parameters(), lr=1e-2)
    return mpt.wrap(model, opt, policy=policy)


def _step(
    model: Any,
    opt: Any,
    step: int,
    set_to_none: bool,
    *,
    micro: int = 1,
    inject_inf: bool = False,
    clip: float | None = None,
) -> None:
    opt.zero_grad(set_to_none=set_to_none)
    x, y = batch(step)
    for part_x, part_y in zip(x.chunk(micro), y.chunk(micro), strict=True):
        loss = F.cross_entropy(model(part_x), part_y)
        with mpt.scale_loss(loss, opt) as scaled:
            scaled.backward()
    if inject_inf:
        grad = next(p.grad for p in model.parameters() if p.grad is not None)
        grad.view(-1)[0] = float("inf")
    if clip is not None:
        mpt.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(mpt.master_params(opt), clip)
    opt.step()


def _grad_ptrs(opt: Any) -> list[int]:
    return [m.grad.data_ptr() for m in mpt.master_params(opt)]


def test_zero_grad_leaves_every_gradient_none() -> None:
    model, opt = _wrapped()
    _step(model, opt, 0, True)
    assert all(m.grad is not None for m in mpt.master_params(opt))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert all(m.grad is None for m in mpt.master_params(opt))
    for group in opt.param_groups:  # what the optimizer's own step would read
        assert all(p.grad is None for p in group["params"])


@pytest.mark.parametrize("policy", ["O2-bf16", "O2"])
def test_the_master_gradient_memory_is_reused_and_training_is_bit_identical(policy: str) -> None:
    runs = {}
    for set_to_none in (True, False):
        model, opt = _wrapped(policy)
        ptrs = []
        for step in range(4):
            _step(model, opt, step, set_to_none)
            ptrs.append(_grad_ptrs(opt))
        assert all(p == ptrs[0] for p in ptrs)  # one buffer per master, whatever the mode
        runs[set_to_none] = snapshot(model, opt)
    assert same(runs[True], runs[False])


def test_a_gradient_the_user_kept_is_never_written() -> None:
    model, opt = _wrapped()
    _step(model, opt, 0, True)
    kept = [m.grad for m in mpt.master_params(opt)]
    values = [g.clone() for g in kept]
    view = mpt.master_params(opt)[1].grad.view(-1)  # a view alone also holds the memory
    for step in range(1, 3):
        _step(model, opt, step, True)
    assert same(kept, values)
    assert same(view, values[1].view(-1))
    assert all(
        m.grad.data_ptr() != g.data_ptr() for m, g in zip(mpt.master_params(opt), kept, strict=True)
    )


def test_accumulation_over_two_micro_batches_matches_set_to_none_false() -> None:
    runs = {}
    for set_to_none in (True, False):
        model, opt = _wrapped()
        for step in range(3):
            _step(model, opt, step, set_to_none, micro=2)
        runs[set_to_none] = snapshot(model, opt)
    assert same(runs[True], runs[False])


def test_a_skipped_step_and_the_steps_after_it_match_set_to_none_false() -> None:
    runs = {}
    for set_to_none in (True, False):
        model, opt = _wrapped("O2")  # float16 with a dynamic loss scale
        _step(model, opt, 0, set_to_none)
        before = snapshot(model, opt)
        _step(model, opt, 1, set_to_none, inject_inf=True)
        assert mpt.state(opt).last_step_skipped
        assert same(snapshot(model, opt), before)  # the skip changed nothing
        for step in range(2, 4):
            _step(model, opt, step, set_to_none)
        assert not mpt.state(opt).last_step_skipped
        runs[set_to_none] = (snapshot(model, opt), mpt.state(opt).loss_scale)
    assert same(runs[True], runs[False])


def test_clipping_after_unscale_matches_set_to_none_false() -> None:
    runs = {}
    for set_to_none in (True, False):
        model, opt = _wrapped()
        for step in range(3):
            _step(model, opt, step, set_to_none, clip=0.05)
        runs[set_to_none] = snapshot(model, opt)
    assert same(runs[True], runs[False])


def test_lbfgs_closures_that_zero_the_gradients_match_set_to_none_false() -> None:
    runs = {}
    for set_to_none in (True, False):
        model, opt = _wrapped(opt_cls=lambda p, lr: torch.optim.LBFGS(p, lr=0.5, max_iter=4))
        x, y = batch(0)

        def closure(
            model: Any = model, opt: Any = opt, x: Any = x, y: Any = y, none: bool = set_to_none
        ) -> torch.Tensor:
            opt.zero_grad(set_to_none=none)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        for _ in range(3):
            opt.step(closure)
        runs[set_to_none] = [m.detach().clone() for m in mpt.master_params(opt)]
    assert same(runs[True], runs[False])
