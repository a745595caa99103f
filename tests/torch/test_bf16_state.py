"""state=bfloat16 on PyTorch: the optimizer state of compensated weights is bfloat16
between steps (half the bytes), rounded stochastically so Adam's second moment still
moves, reproducible from the seed and resumed bit for bit from a checkpoint."""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")

from _torch_nets import TANH_X, TANH_Y, tanh_net, train_tanh, working_bytes  # noqa: E402
from torch import nn  # noqa: E402

import mixprec  # noqa: E402
from mixprec.errors import PolicyError  # noqa: E402

pytestmark = pytest.mark.torch

POLICIES = ["O3-bf16-kahan,state=bfloat16", "O3-bf16-sr,state=bfloat16"]

Make = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Make] = {
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True),
    "adamw-amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-3, amsgrad=True, foreach=False),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
}


def _wrapped(
    policy: str, make: Make = OPTIMIZERS["adam"], seed: int = 3
) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = tanh_net()
    opt = make(list(model.parameters()))
    return mixprec.torch.wrap(model, opt, policy=policy, seed=seed)


def _moments(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every floating per-parameter state tensor (not the step counters)."""
    return [
        v
        for state in opt.state.values()
        for k, v in state.items()
        if k != "step" and isinstance(v, torch.Tensor) and v.dim() > 0
    ]


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages behind the optimizer's per-parameter state tensors."""
    storages = {}
    for t in _moments(opt):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("make", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_any_optimizer_trains_with_bfloat16_state(policy: str, make: Make) -> None:
    model, opt = _wrapped(policy, make)
    losses = train_tanh(model, opt, 20)
    assert losses[-1] < losses[0]
    moments = _moments(opt)
    assert moments and {t.dtype for t in moments} == {torch.bfloat16}
    # the working masters and the state's float32 buffer hold no memory between steps
    assert working_bytes(opt) <= 4  # one float32 NaN the storage-less masters read as


@pytest.mark.parametrize("base", ["O3-bf16-kahan", "O3-bf16-sr"])
def test_state_memory_between_steps_halves(base: str) -> None:
    full_model, full_opt = _wrapped(base)
    half_model, half_opt = _wrapped(f"{base},state=bfloat16")
    train_tanh(full_model, full_opt, 2)
    train_tanh(half_model, half_opt, 2)
    params = sum(p.numel() for p in half_model.parameters())
    assert _state_bytes(full_opt) == 8 * params  # exp_avg + exp_avg_sq in float32
    assert _state_bytes(half_opt) == 4 * params  # the same two in bfloat16


def test_state_is_float32_inside_a_generic_update() -> None:
    """RMSprop takes the generic path: its own update sees float32 state."""
    model, opt = _wrapped(POLICIES[0], OPTIMIZERS["rmsprop"])
    seen: list[torch.dtype] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.extend(t.dtype for t in _moments(o)))
    opt.register_step_post_hook(lambda o, a, k: seen.extend(t.dtype for t in _moments(o)))
    train_tanh(model, opt, 2)
    # the hooks run inside step(), around the optimizer's update: float32 state there
    assert seen and set(seen) == {torch.float32}
    assert {t.dtype for t in _moments(opt)} == {torch.bfloat16}


def _constant_gradient_v(policy: str, steps: int) -> float:
    """Mean Adam second moment after ``steps`` steps of a gradient of 1 everywhere,
    starting from a first step with gradient 2 (so v must fall from 4 towards 1)."""
    model = nn.Linear(256, 1, bias=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-6, betas=(0.9, 0.999))
    model, opt = mixprec.torch.wrap(model, opt, policy=policy, seed=11)
    for step in range(steps):
        opt.zero_grad()
        scale = 2.0 if step == 0 else 1.0
        (model.weight.float().sum() * scale).backward()
        opt.step()
    return float(opt.state[mixprec.torch.master_params(opt)[0]]["exp_avg_sq"].float().mean())


def test_stochastic_rounding_keeps_the_second_moment_moving() -> None:
    """Adam's v climbs from 4e-3 towards g**2 = 1 by 1e-3 * (1 - v) per step; rounded to
    nearest bfloat16 it stalls at 0.25, where that is below half the spacing (2**-10).
    Stochastic rounding follows the float32 trajectory on average."""
    steps = 2000
    exact = _constant_gradient_v("O3-bf16-kahan", steps)  # float32 state
    rounded = _constant_gradient_v("O3-bf16-kahan,state=bfloat16", steps)
    # what nearest rounding would give: the same recurrence on a bfloat16 v
    v = torch.tensor(0.0, dtype=torch.bfloat16)
    for step in range(steps):
        g2 = 4.0 if step == 0 else 1.0
        v = (0.999 * v.float() + 0.001 * g2).to(torch.bfloat16)
    nearest = float(v)
    assert nearest == 0.25 and exact > 0.8  # nearest rounding stagnates far below
    assert rounded == pytest.approx(exact, rel=0.01)


@pytest.mark.parametrize("policy", POLICIES)
def test_the_seed_makes_runs_reproducible(policy: str) -> None:
    a_model, a_opt = _wrapped(policy, seed=4)
    b_model, b_opt = _wrapped(policy, seed=4)
    c_model, c_opt = _wrapped(policy, seed=5)
    for model, opt in ((a_model, a_opt), (b_model, b_opt), (c_model, c_opt)):
        train_tanh(model, opt, 5)
    assert all(torch.equal(a, b) for a, b in zip(_moments(a_opt), _moments(b_opt), strict=True))
    assert not all(torch.equal(a, c) for a, c in zip(_moments(a_opt), _moments(c_opt), strict=True))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(
    "make",
    [OPTIMIZERS["adam"], OPTIMIZERS["adamw-foreach"], OPTIMIZERS["sgd-momentum"]],
    ids=["adam", "adamw", "sgd-momentum"],
)
def test_resume_repeats_the_trajectory_bit_for_bit(policy: str, make: Make) -> None:
    model, opt = _wrapped(policy, make, seed=3)
    train_tanh(model, opt, 4)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    saved_state = [v for v in opt.state_dict()["state"][0].values() if v.dim() > 0]
    assert {v.dtype for v in saved_state} == {torch.bfloat16}
    train_tanh(model, opt, 4)

    other = tanh_net(seed=7)  # other weights, another seed: the checkpoint must decide all
    other, other_opt = mixprec.torch.wrap(
        other, make(list(other.parameters())), policy=policy, seed=99
    )
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    other.load_state_dict(saved["model"])
    other_opt.load_state_dict(saved["optimizer"])
    # torch casts loaded state to the working masters' float32; it is bfloat16 again
    assert {t.dtype for t in _moments(other_opt)} == {torch.bfloat16}
    train_tanh(other, other_opt, 4)
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(_moments(opt), _moments(other_opt), strict=True):
        assert torch.equal(a, b)


def test_a_skipped_step_leaves_the_state_alone() -> None:
    model, opt = _wrapped(POLICIES[1])
    train_tanh(model, opt, 2)
    before = [t.clone() for t in _moments(opt)]
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(TANH_X).float(), TANH_Y)
    loss.backward()
    next(iter(model.parameters())).grad.view(-1)[0] = float("inf")
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, _moments(opt), strict=True))


@pytest.mark.parametrize("spec", ["O2-bf16", "O3-bf16", "O1-bf16"])
def test_bfloat16_state_without_a_strategy_is_refused(spec: str) -> None:
    model = tanh_net()
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(PolicyError, match="master='kahan' or 'stochastic'"):
        mixprec.torch.wrap(model, opt, policy=f"{spec},state=bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
