"""master=kahan and master=stochastic on PyTorch: small updates survive bfloat16 weights,
any optimizer works, checkpoints save weight + compensation and resume bit for bit."""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")

from _torch_nets import tanh_net, train_tanh, working_bytes  # noqa: E402
from torch import nn  # noqa: E402

import mixprec  # noqa: E402
from mixprec.errors import CheckpointError  # noqa: E402

pytestmark = pytest.mark.torch

STEPS = 200
LR = 2**-12  # an eighth of half the bfloat16 spacing at 1.0: rounds away in plain bfloat16


def _pushed(policy: str, optimizer: str = "sgd") -> float:
    """Weights of 1.0 pushed up by LR per step; how far the best saved value moved.

    Under sr each weight rounds up with probability 1/32 per step: the mean over 4,096
    weights is within 5 % of the expected push with eight standard deviations to spare (over
    64 weights 5 % was one standard deviation: whether it passed depended on the stream)."""
    model = nn.Linear(4096, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt = mixprec.torch.wrap(model, opt, policy=policy, seed=5)
    for _ in range(STEPS):
        opt.zero_grad()
        (-model.weight.float().sum()).backward()
        opt.step()
    return float(model.state_dict()["weight"].mean()) - 1.0


def test_small_updates_survive_the_strategies_and_vanish_in_plain_bfloat16() -> None:
    wanted = STEPS * LR
    assert _pushed("O3-bf16") == 0.0
    assert _pushed("O2-bf16") == pytest.approx(wanted, rel=1e-5)
    assert _pushed("O3-bf16-kahan") == pytest.approx(wanted, rel=1e-3)
    assert _pushed("O3-bf16-sr") == pytest.approx(wanted, rel=0.05)


OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
    "adam-for-loop": lambda p: torch.optim.Adam(p, lr=1e-3, foreach=False),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3),
}


@pytest.mark.parametrize("policy", ["O3-bf16-kahan", "O3-bf16-sr"])
@pytest.mark.parametrize("make", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_any_optimizer_trains_and_keeps_its_class(
    policy: str, make: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
) -> None:
    model = tanh_net()
    opt = make(list(model.parameters()))
    kind = type(opt)
    model, opt = mixprec.torch.wrap(model, opt, policy=policy)
    assert isinstance(opt, kind)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    losses = train_tanh(model, opt, 20)
    assert losses[-1] < losses[0]
    # between steps the float32 working masters hold no memory
    assert working_bytes(opt) <= 4  # one float32 NaN the storage-less masters read as


@pytest.mark.parametrize("policy", ["O3-bf16-kahan", "O3-bf16-sr"])
def test_resume_repeats_the_trajectory_bit_for_bit(policy: str) -> None:
    model = tanh_net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = mixprec.torch.wrap(model, opt, policy=policy, seed=3)
    train_tanh(model, opt, 4)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    train_tanh(model, opt, 4)

    other = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))  # other weights
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-3)
    other, other_opt = mixprec.torch.wrap(other, other_opt, policy=policy, seed=99)
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    other.load_state_dict(saved["model"])
    other_opt.load_state_dict(saved["optimizer"])
    train_tanh(other, other_opt, 4)
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True)
    )


def test_saved_weights_are_weight_plus_compensation() -> None:
    model = tanh_net()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = mixprec.torch.wrap(model, opt, policy="O3-bf16-kahan")
    saved = model.state_dict()
    for key, value in initial.items():
        assert saved[key].dtype == torch.float32
        # the compensation keeps what bfloat16 drops of the initial float32 weights
        assert torch.allclose(saved[key], value, rtol=2**-15, atol=0)
        assert not torch.equal(saved[key], value.to(torch.bfloat16).float())


def test_plain_float32_state_dict_loads_into_a_compensated_model() -> None:
    plain = tanh_net()
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mixprec.torch.wrap(model, opt, policy="O3-bf16-kahan")
    model.load_state_dict(plain.state_dict())
    for key, value in plain.state_dict().items():
        assert torch.allclose(model.state_dict()[key], value, rtol=2**-15, atol=0)


def test_optimizer_state_from_another_strategy_is_refused_before_loading() -> None:
    kahan_model = tanh_net()
    kahan_opt = torch.optim.SGD(kahan_model.parameters(), lr=0.1)
    kahan_model, kahan_opt = mixprec.torch.wrap(kahan_model, kahan_opt, policy="O3-bf16-kahan")
    sr_model = tanh_net()
    sr_opt = torch.optim.SGD(sr_model.parameters(), lr=0.1, momentum=0.9)
    sr_model, sr_opt = mixprec.torch.wrap(sr_model, sr_opt, policy="O3-bf16-sr")
    train_tanh(sr_model, sr_opt, 1)
    before = kahan_opt.state_dict()
    with pytest.warns(mixprec.MixprecWarning), pytest.raises(CheckpointError, match="kahan"):
        kahan_opt.load_state_dict(sr_opt.state_dict())
    assert kahan_opt.state_dict()["state"] == before["state"]


@pytest.mark.parametrize("policy", ["O3-bf16-kahan", "O3-bf16-sr", "O3-bf16-kahan,state=bfloat16"])
def test_sliced_passes_give_the_bits_of_one_pass(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The generic path's flat passes run in slices (bounded temporaries); slices that cut
    through parameters must not change a bit of the weights, the compensation (kahan), the
    optimizer state or the stochastic rounding's noise (sr, bfloat16 state)."""
    from mixprec_torch.cpu import noise

    def run() -> list[torch.Tensor]:
        net = tanh_net()
        model, opt = mixprec.torch.wrap(  # RMSprop: the generic path, not the fused update
            net, torch.optim.RMSprop(net.parameters(), lr=1e-2, momentum=0.5), policy=policy
        )
        train_tanh(model, opt, 5)
        sd = opt.state_dict()
        kept = sd["mixprec"]["compensation"]
        assert kept["noise"]["draws"] == [5]
        moments = [v for s in sd["state"].values() for k, v in s.items() if k != "step"]
        return [*kept["compensation"], *moments, *model.state_dict().values()]

    whole = run()
    monkeypatch.setattr(noise, "SLICE", 7)  # 7 does not divide any parameter size
    monkeypatch.setenv("MIXPREC_NATIVE", "0")  # the torch noise, drawn slice by slice
    monkeypatch.setattr(noise.clib, "_state", {})
    sliced = run()
    assert len(whole) == len(sliced)
    for a, b in zip(whole, sliced, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_a_checkpoint_loaded_before_wrap_gives_back_the_saved_weights() -> None:
    """Lightning restores the module's state dict before the precision plugin wraps it. A
    saved kahan weight ``w`` with a compensation of exactly half a bfloat16 step is saved as
    ``w + c``, which rounds (ties to even) to ``w``'s neighbour wherever ``w`` is odd; loading
    the optimizer state must give back ``w`` itself."""
    model, opt = _wrapped_sgd()
    train_tanh(model, opt, 2)
    weight = model[0].weight.detach().clone()  # bfloat16, the first of the flat buffer
    odd = (weight.view(torch.int16) & 1).bool()
    half_step = torch.ldexp(torch.ones_like(weight, dtype=torch.float32), _exponent(weight) - 8)
    comp = torch.where(odd, half_step, 0.0).to(torch.bfloat16)
    model_sd = model.state_dict()
    model_sd["0.weight"] = weight.float() + comp.float()  # exact in float32
    opt_sd = opt.state_dict()
    saved = opt_sd["mixprec"]["compensation"]["compensation"][0]
    saved[: weight.numel()] = comp.flatten()
    assert odd.any() and not torch.equal(model_sd["0.weight"].to(torch.bfloat16), weight)

    net = tanh_net()
    net.load_state_dict(model_sd)  # before wrap, as Lightning does
    resumed, resumed_opt = mixprec.torch.wrap(
        net, torch.optim.SGD(net.parameters(), lr=0.1), policy="O3-bf16-kahan"
    )
    resumed_opt.load_state_dict(opt_sd)
    assert torch.equal(resumed[0].weight.detach(), weight)
    assert torch.equal(resumed.state_dict()["0.weight"], model_sd["0.weight"])


def _wrapped_sgd() -> tuple[nn.Module, torch.optim.Optimizer]:
    net = tanh_net()
    return mixprec.torch.wrap(
        net, torch.optim.SGD(net.parameters(), lr=0.1), policy="O3-bf16-kahan"
    )


def _exponent(x: torch.Tensor) -> torch.Tensor:
    """floor(log2(|x|)) of each nonzero element (0 for zeros)."""
    return torch.frexp(x.float())[1] - 1


@pytest.mark.parametrize("seed", [-1, "7", 1.5, True])
def test_a_bad_seed_is_refused_before_the_model_changes(seed: object) -> None:
    from mixprec.errors import WrapError

    model = tanh_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(WrapError, match="seed must be a non-negative int"):
        mixprec.torch.wrap(model, opt, policy="O3-bf16-sr", seed=seed)  # type: ignore[arg-type]
    for key, value in model.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, before[key]), key


# ---------------------------------------------------------------- issue 21, items 3 and 5


@pytest.mark.parametrize("policy", ["O3-bf16-kahan", "O3-bf16-sr"])
@pytest.mark.parametrize("make", [OPTIMIZERS["adamw-foreach"], OPTIMIZERS["rmsprop"]],
                         ids=["fused", "generic"])  # fmt: skip
def test_masters_are_readable_between_steps(
    policy: str, make: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
) -> None:
    """The guide's EMA recipe reads the masters between steps: it used to read freed memory
    (exit 139). They hold ``w + c`` (kahan) or ``w`` from ``master_params()`` to the next
    step, and whatever else reads the optimizer's params between steps gets NaN, not a crash."""
    model = tanh_net()
    model, opt = mixprec.torch.wrap(model, make(list(model.parameters())), policy=policy)
    train_tanh(model, opt, 2)
    raw = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    assert all(r.isnan().all() for r in raw)  # no memory behind them: NaN, never a crash
    ema = [m.detach().clone() for m in mixprec.torch.master_params(opt)]
    saved = model.state_dict()  # w + c in float32 (w under sr)
    assert len(ema) == len(saved)
    for value, (key, expected) in zip(ema, saved.items(), strict=True):
        assert torch.equal(value, expected), key
    train_tanh(model, opt, 1)  # the step still works, and leaves them stale and storage-less
    assert working_bytes(opt) <= 4
    for e, m in zip(ema, mixprec.torch.master_params(opt), strict=True):
        e.lerp_(m.detach(), 0.1)  # the recipe's update: now the new values
    assert all(e.isfinite().all() for e in ema)


@pytest.mark.parametrize("policy", ["O3-bf16-kahan", "O3-bf16-sr"])
def test_ema_helper_averages_compensated_weights(policy: str) -> None:
    model = tanh_net()
    model, opt = mixprec.torch.wrap(
        model, torch.optim.SGD(model.parameters(), lr=0.1), policy=policy
    )
    ema = mixprec.torch.ema(model, decay=0.5)
    values = []
    for _ in range(2):
        train_tanh(model, opt, 1)
        ema.update_parameters(model)
        values.append(model.state_dict())
    averaged = ema.state_dict()
    for key, last in values[-1].items():
        expected = 0.5 * values[0][key] + 0.5 * last
        torch.testing.assert_close(averaged[f"module.{key}"], expected, rtol=2**-14, atol=1e-7)


class _SubclassedSGD(torch.optim.SGD):
    """SGD under another class: the compensated presets' generic path (not the fused one)."""


@pytest.mark.parametrize("policy", ["O2-bf16", "O3-bf16-kahan", "O3-bf16-sr"])
@pytest.mark.parametrize(
    "make",
    [OPTIMIZERS["sgd-momentum"], lambda p: _SubclassedSGD(p, lr=0.05, momentum=0.9)],
    ids=["fused", "generic"],
)
@pytest.mark.parametrize("what", ["model", "masters"])
def test_clipping_after_unscale_is_honoured(
    policy: str, make: Callable[[list[nn.Parameter]], torch.optim.Optimizer], what: str
) -> None:
    """``unscale_``, a clip to 1e-6, then ``step()``: the update is the clipped one. Under
    the compensated presets a clip of the model's gradients used to be ignored (the full
    update, 0.49 against 6.6e-7 under O2-bf16)."""
    model = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.5)
    model, opt = mixprec.torch.wrap(model, make(list(model.parameters())), policy=policy)
    before = model.state_dict()["weight"].clone()
    opt.zero_grad()
    model(torch.ones(2, 4)).float().sum().backward()
    mixprec.torch.unscale_(opt)
    clipped = model.parameters() if what == "model" else mixprec.torch.master_params(opt)
    torch.nn.utils.clip_grad_norm_(clipped, 1e-6)
    opt.step()
    moved = float((model.state_dict()["weight"] - before).abs().max())
    assert moved < 1e-5  # the clipped update: lr 0.05 times a gradient norm of 1e-6


def test_an_optimizer_state_from_the_generator_era_is_refused() -> None:
    """Earlier versions kept ``torch.Generator`` states; the counter-based noise cannot
    continue them: refused before anything is loaded, naming what to do."""
    model = tanh_net()
    model, opt = mixprec.torch.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), policy="O3-bf16-sr"
    )
    train_tanh(model, opt, 2)
    sd = opt.state_dict()
    kept = sd["mixprec"]["compensation"]
    kept["generators"] = [torch.Generator().get_state()]
    del kept["noise"]
    before = opt.state_dict()
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError, match=r"earlier mixprec.*counter-based"):
        opt.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    after = opt.state_dict()
    assert after["mixprec"]["compensation"]["noise"] == before["mixprec"]["compensation"]["noise"]
