"""The overflow decision of a round, member by member, and the flag each rank sends.

A *round* (``scale_loss(loss, [opt_a, opt_b])``, then the first ``step()``) unscales and
checks every member, decides once and hands each member its decision; what a user does to a
member between the round and its own ``step()`` (``unscale_``, a clip, an edit, another
round) is checked there. The multi-rank tests run in this process: the all-reduce is
replaced by a peer that answers with its own flag (MAX, as gloo and NCCL reduce it), so the
flag this rank sends and the decision it takes from the answer are both seen, or by one that
failed (the all-reduce raises, as gloo's does when a peer is gone).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import mixprec.torch as mpt  # noqa: E402
from mixprec.errors import DistributedError, StepOrderError  # noqa: E402

pytestmark = pytest.mark.torch

SCALE = "static:1024"


def _pair(
    policy: str = "O2", **overrides: Any
) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    """Two linear models, one SGD optimizer each, wrapped together (one scaler)."""
    torch.manual_seed(0)
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b)]
    (a, b), (opt_a, opt_b) = mpt.wrap([a, b], opts, policy, **overrides)
    return a, b, opt_a, opt_b


def _backward(
    a: nn.Module, b: nn.Module, opts: list[torch.optim.Optimizer], x: torch.Tensor
) -> None:
    """One scaled backward pass of ``sum(a(x)) + sum(b(x))`` for ``opts``."""
    with mpt.scale_loss((a(x).float() + b(x).float()).sum(), opts) as scaled:
        scaled.backward()


def _weights(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in mpt.master_params(opt)]


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to the float16 rounding of the model's gradients."""
    torch.testing.assert_close(actual, expected, rtol=1e-3, atol=1e-3)


class _ScalarReads(TorchDispatchMode):
    """Counts the scalars read from tensors (``item()``, ``bool()``, ``float()``): each one a
    host sync on an accelerator. A dispatch mode (torch's private hook) sees every one, as
    ``aten._local_scalar_dense``, whichever Python call asked for it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def _host_syncs(run: Callable[[], object]) -> int:
    """How many scalars ``run`` read from tensors."""
    with _ScalarReads() as reads:
        run()
    return reads.count


# ---------------------------------------------------------------------- a round's members


def test_a_member_unscaled_and_clipped_before_the_round_steps_with_its_clip() -> None:
    """``unscale_(opt_b)`` and a clip of its gradients, then ``opt_a.step()`` opens the
    round: opt_b is checked as clipped (not unscaled again) and applies the clip."""
    a, b, opt_a, opt_b = _pair(loss_scale=SCALE)
    x = torch.randn(4, 3)
    _backward(a, b, [opt_a, opt_b], x)
    mpt.unscale_(opt_b)
    for master in mpt.master_params(opt_b):
        master.grad.mul_(0.5)  # a clip by hand: half the true gradient
    before_a, before_b = _weights(opt_a), _weights(opt_b)
    opt_a.step()
    opt_b.step()
    want = x.sum(0).expand(2, 3)  # d(sum of m(x))/d(m.weight), unscaled
    _close(mpt.master_params(opt_a)[0], before_a[0] - 0.1 * want)
    _close(mpt.master_params(opt_b)[0], before_b[0] - 0.05 * want)
    assert mpt.state(opt_b).skipped_steps == 0


def test_a_member_unscaled_by_the_round_refuses_a_second_unscale() -> None:
    """The round unscaled opt_b; the first ``unscale_(opt_b)`` finds it done, a second one
    is refused as for any optimizer, and opt_b applies its gradient once unscaled."""
    a, b, opt_a, opt_b = _pair(loss_scale=SCALE)
    x = torch.randn(4, 3)
    _backward(a, b, [opt_a, opt_b], x)
    opt_a.step()
    mpt.unscale_(opt_b)
    with pytest.raises(StepOrderError, match="already been called"):
        mpt.unscale_(opt_b)
    before = _weights(opt_b)
    opt_b.step()
    want = x.sum(0).expand(2, 3)
    _close(mpt.master_params(opt_b)[0], before[0] - 0.1 * want)


def test_a_member_keeps_its_decision_when_another_optimizer_opens_the_next_round() -> None:
    """opt_a steps, runs its next backward pass (which overflows) and steps again before
    opt_b steps: that second round is opt_a's alone; opt_b applies its finite gradients,
    which its own round checked."""
    a, b, opt_a, opt_b = _pair(loss_scale=SCALE)
    x = torch.randn(4, 3)
    _backward(a, b, [opt_a, opt_b], x)
    opt_a.step()
    with mpt.scale_loss(a(x).float().sum() * math.inf, opt_a) as scaled:
        scaled.backward()
    opt_a.step()
    assert mpt.state(opt_a).last_step_skipped
    assert all(not name.startswith("model1.") for name in mpt.overflowing_params(opt_b))
    before = _weights(opt_b)
    opt_b.step()
    want = x.sum(0).expand(2, 3)
    _close(mpt.master_params(opt_b)[0], before[0] - 0.1 * want)
    assert mpt.state(opt_b).skipped_steps == 1  # the shared counter: opt_a's skip only


def test_a_gradient_replaced_after_the_round_is_checked_at_its_own_step() -> None:
    """Not written in place (its version counter stays): a new tensor in ``.grad``."""
    a, b, opt_a, opt_b = _pair("O2-bf16")
    _backward(a, b, [opt_a, opt_b], torch.randn(4, 3))
    opt_a.step()
    master = mpt.master_params(opt_b)[0]
    replaced = torch.full_like(master.grad, math.nan)
    assert replaced._version == master.grad._version  # only the identity tells them apart
    master.grad = replaced
    before = _weights(opt_b)
    opt_b.step()
    assert all(torch.equal(p, q) for p, q in zip(mpt.master_params(opt_b), before, strict=True))
    assert torch.isfinite(b.weight).all()


def test_a_member_that_skips_alone_says_so_in_its_state() -> None:
    """The documented ``if not state(opt).last_step_skipped: scheduler.step()`` held the
    schedule of the round's skips but not of a member's own (its gradient written after the
    round's check): its state said "not skipped" while its weights did not move."""
    a, b, opt_a, opt_b = _pair("O2-bf16")
    x = torch.randn(4, 3)
    _backward(a, b, [opt_a, opt_b], x)
    opt_a.step()
    mpt.master_params(opt_b)[0].grad.fill_(math.inf)  # in place, after the round's check
    before = _weights(opt_b)
    opt_b.step()
    assert all(torch.equal(p, q) for p, q in zip(mpt.master_params(opt_b), before, strict=True))
    own, shared = mpt.state(opt_b), mpt.state(opt_a)
    assert (own.last_step_skipped, own.skipped_steps) == (True, 1)
    assert (shared.last_step_skipped, shared.skipped_steps) == (False, 0)
    assert own.steps == shared.steps == 1
    for opt in (opt_a, opt_b):
        opt.zero_grad()
    _backward(a, b, [opt_a, opt_b], x)
    opt_a.step()
    opt_b.step()
    own = mpt.state(opt_b)
    assert (own.last_step_skipped, own.skipped_steps, own.steps) == (False, 1, 2)


@pytest.mark.parametrize("unscale", [False, True], ids=["step", "unscale_-step"])
@pytest.mark.parametrize("policy", ["O2-bf16", "O1", "O2"])
def test_a_member_left_alone_after_the_round_steps_without_a_host_sync(
    policy: str, unscale: bool
) -> None:
    """The round read the decision once; opt_b's ``unscale_`` (the round did it) and its own
    step, its gradients untouched since, read nothing from the device again."""
    overrides = {"loss_scale": SCALE} if policy != "O2-bf16" else {}
    a, b, opt_a, opt_b = _pair(policy, **overrides)
    _backward(a, b, [opt_a, opt_b], torch.randn(4, 3))
    opt_a.step()
    before = _weights(opt_b)
    if unscale:
        mpt.unscale_(opt_b)
    assert _host_syncs(opt_b.step) == 0
    after = mpt.master_params(opt_b)
    assert not any(torch.equal(p, q) for p, q in zip(after, before, strict=True))


def test_a_statistics_guard_with_nothing_to_flag_leaves_the_decision_to_the_gradients() -> None:
    """A BatchNorm in eval mode updates no running statistic: its guard has no flag for the
    round (None, not a zero flag), and the step is applied."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mpt.wrap(model, opt, "O2", loss_scale=SCALE)
    model.eval()
    with mpt.scale_loss(model(torch.randn(4, 3).half()).float().sum(), opt) as scaled:
        scaled.backward()
    before = _weights(opt)
    opt.step()
    assert not mpt.state(opt).last_step_skipped
    assert not torch.equal(mpt.master_params(opt)[0], before[0])


# ---------------------------------------------------------------------- the flag each rank sends


@pytest.fixture(params=["native", "twin"])
def rank_model(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model of this rank and its optimizer, wrapped: its guard pass runs the native CPU
    kernel (a verdict on the host) or, as on a machine without the kernels
    (``MIXPREC_NATIVE=0``), its torch twin (flags on the device)."""
    if request.param == "twin":
        from mixprec_torch.cpu import clib

        monkeypatch.setattr(clib, "_state", {"lib": None, "reason": "switched off by a test"})
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return mpt.wrap(model, opt, "O2", loss_scale=SCALE)


def _rank_backward(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    with mpt.scale_loss(model(torch.randn(4, 3).half()).float().sum(), opt) as scaled:
        scaled.backward()


@pytest.fixture
def peer(monkeypatch: pytest.MonkeyPatch) -> Callable[[bool], list[float]]:
    """Two ranks as this process sees them: ``peer(overflowed)`` makes the found_inf
    all-reduce answer with the MAX of this rank's flag and the other rank's; returns the
    flags this rank sent, in order."""
    import mixprec_torch.step.protocol as protocol

    sent: list[float] = []
    state = {"overflowed": False}

    def all_reduce(found: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        sent.append(found.item())
        return found.clamp_(min=float(state["overflowed"]))

    monkeypatch.setattr(protocol, "is_distributed", lambda *_: True)
    monkeypatch.setattr(protocol, "all_reduce_found_inf", all_reduce)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *_: 0)  # the skip warning's

    def start(overflowed: bool) -> list[float]:
        state["overflowed"] = overflowed
        return sent

    return start


@pytest.mark.parametrize("nan", [False, True], ids=["finite", "nan"])
def test_each_rank_sends_its_own_verdict(
    peer: Callable[[bool], list[float]],
    rank_model: tuple[nn.Module, torch.optim.Optimizer],
    nan: bool,
) -> None:
    sent = peer(False)
    model, opt = rank_model
    _rank_backward(model, opt)
    if nan:
        model.weight.grad[0, 0] = math.nan
    opt.step()
    assert [flag > 0 for flag in sent] == [nan]  # one flag: 0, or positive (MAX-reduced)
    assert mpt.state(opt).last_step_skipped is nan


def test_a_finite_rank_skips_with_its_overflowing_peer(
    peer: Callable[[bool], list[float]], rank_model: tuple[nn.Module, torch.optim.Optimizer]
) -> None:
    sent = peer(True)
    model, opt = rank_model
    before = [p.detach().clone() for p in model.parameters()]
    _rank_backward(model, opt)
    opt.step()
    assert sent == [0.0]
    assert mpt.state(opt).last_step_skipped
    assert mpt.overflowing_params(opt) == []  # only the other rank overflowed
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("overflowed", [False, True], ids=["peer-finite", "peer-overflowed"])
def test_a_rank_without_gradients_joins_with_a_zero_flag(
    peer: Callable[[bool], list[float]],
    rank_model: tuple[nn.Module, torch.optim.Optimizer],
    overflowed: bool,
) -> None:
    sent = peer(overflowed)
    model, opt = rank_model
    unrelated = torch.ones(1, requires_grad=True)  # this rank's loss does not reach the model
    with mpt.scale_loss((unrelated * 2).sum(), opt) as scaled:
        scaled.backward()
    assert all(p.grad is None for p in model.parameters())
    opt.step()
    assert sent == [0.0]
    assert mpt.state(opt).last_step_skipped is overflowed


def test_a_round_of_both_paths_sends_one_flag_for_both(
    peer: Callable[[bool], list[float]],
) -> None:
    """A native member's host verdict and the device flag of a member the kernel cannot
    take (a sparse gradient), summed into the one flag of the round: an overflow in either
    one is sent."""
    sent = peer(False)
    torch.manual_seed(0)
    dense, sparse = nn.Linear(3, 2), nn.Embedding(5, 2, sparse=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (dense, sparse)]
    (dense, sparse), (opt_d, opt_s) = mpt.wrap([dense, sparse], opts, "O1", loss_scale=SCALE)
    for overflow in ("dense", "sparse"):
        loss = dense(torch.randn(4, 3)).sum() + sparse(torch.tensor([1, 3])).sum()
        with mpt.scale_loss(loss, [opt_d, opt_s]) as scaled:
            scaled.backward()
        (dense if overflow == "dense" else sparse).weight.grad.mul_(math.inf)
        opt_d.step()
        opt_s.step()
        assert mpt.state(opt_s).last_step_skipped, overflow
    assert len(sent) == 2 and all(flag > 0 for flag in sent)  # MAX-reduced: any positive


# ---------------------------------------------------------------------- unscale_ after the round


def test_unscale_after_the_round_gives_the_model_its_unscaled_gradients_to_clip() -> None:
    """``unscale_(opt_b)`` after ``opt_a.step()`` opened the round: the model's gradients
    hold the true values (they held the scaled ones, 1024 times too large), and a clip of
    them is what opt_b applies (it was dropped)."""
    a, b, opt_a, opt_b = _pair(loss_scale=SCALE)
    x = torch.randn(4, 3)
    _backward(a, b, [opt_a, opt_b], x)
    opt_a.step()
    mpt.unscale_(opt_b)
    want = x.sum(0).expand(2, 3)
    _close(b.weight.grad.float(), want)
    norm = float(torch.nn.utils.clip_grad_norm_(b.parameters(), 0.01))
    before = _weights(opt_b)
    opt_b.step()
    _close(mpt.master_params(opt_b)[0], before[0] - 0.1 * want * (0.01 / norm))


def test_a_nan_written_into_the_models_gradients_after_unscale_is_checked() -> None:
    """As the clip: the model's gradient reaches the masters' and is checked at the step."""
    a, b, opt_a, opt_b = _pair(loss_scale=SCALE)
    _backward(a, b, [opt_a, opt_b], torch.randn(4, 3))
    opt_a.step()
    mpt.unscale_(opt_b)
    b.weight.grad[0, 0] = math.nan
    before = _weights(opt_b)
    opt_b.step()  # its own skip: the round's decision, and the scale, stand
    assert all(torch.equal(p, q) for p, q in zip(mpt.master_params(opt_b), before, strict=True))
    assert torch.isfinite(b.weight).all()


@pytest.fixture
def failed_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks, the other one gone: the found_inf all-reduce fails (as gloo's does)."""
    import mixprec_torch.step.distributed as distributed
    import mixprec_torch.step.protocol as protocol

    class Failed:
        def wait(self, timeout: Any = None) -> None:
            raise RuntimeError("Connection closed by peer")

    for module in (distributed, protocol):
        monkeypatch.setattr(module, "is_distributed", lambda *_: True)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *_, **__: Failed())
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *_: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *_: 0)


@pytest.mark.usefixtures("failed_peer")
def test_a_failed_peer_is_reported_with_the_step_it_failed_at() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    model, opt = mpt.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2-bf16")
    _rank_backward(model, opt)
    with pytest.raises(DistributedError, match=r"failed on rank 0 of 2 at step 0 after"):
        opt.step()


@pytest.mark.usefixtures("failed_peer")
def test_the_apex_shims_check_reports_a_failed_peer_at_this_step() -> None:
    """Its check runs as ``scale_loss`` exits, where there is no step count to name."""
    from mixprec.compat import apex_amp as amp

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    model, opt = amp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0
    )
    loss = model(torch.randn(4, 3)).float().sum()
    with (
        pytest.raises(DistributedError, match=r"failed on rank 0 of 2 at this step after"),
        amp.scale_loss(loss, opt) as scaled,
    ):
        scaled.backward()
