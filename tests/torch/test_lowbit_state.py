"""state=int8|int4|fp8 on PyTorch: the optimizer's moments are kept as block-wise codes
between steps under every master strategy whose optimizer updates float32 tensors; a skipped
step leaves them bit for bit, a checkpoint stores them (small, ``weights_only``-loadable)
and resumes exactly, another format is refused, a float32 checkpoint loads and converts."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import mixprec  # noqa: E402
import mixprec.torch as mpt  # noqa: E402
from mixprec.errors import CheckpointError, MixprecWarning, PolicyError, WrapError  # noqa: E402
from mixprec.kit import LOWBIT_FORMATS, parse_state_format  # noqa: E402
from mixprec_torch.lowbit.codec import dequantize, quantize  # noqa: E402

pytestmark = pytest.mark.torch

STRATEGIES = ["O0", "O2", "O2-bf16", "O3-bf16-kahan", "O3-bf16-sr"]
Make = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Make] = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
    "adam-amsgrad": lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9),
}


def _net() -> nn.Module:
    torch.manual_seed(0)
    # 8192 and 2048 weights: the first is quantized by default (min_size 4096), the second not
    return nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 8))


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    teacher = nn.Linear(32, 8)
    with torch.no_grad():
        teacher.weight.copy_(torch.randn(8, 32, generator=g) / 4)
        xs = [torch.randn(16, 32, generator=g) for _ in range(n)]
        return [(x, torch.tanh(teacher(x))) for x in xs]


def _wrapped(policy: str, make: Make = OPTIMIZERS["adamw"]) -> tuple[nn.Module, Any]:
    model = _net()
    return mpt.wrap(model, make(list(model.parameters())), policy=policy)


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches: list[Any]) -> list[float]:
    losses = []
    for x, y in batches:
        loss = nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad()
        with mpt.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _snapshot(opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    return [
        (k, v.clone())
        for state in opt.state.values()
        for k, v in sorted(state.items())
        if isinstance(v, torch.Tensor)
    ]


def _same(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(
        ka == kb and va.dtype == vb.dtype and torch.equal(va, vb)
        for (ka, va), (kb, vb) in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("base", STRATEGIES)
@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_every_strategy_trains_with_quantized_moments(base: str, fmt: str) -> None:
    model, opt = _wrapped(f"{base},state={fmt}")
    losses = _train(model, opt, _batches(12))
    assert losses[-1] < losses[0] * 0.8
    big, small = (opt.state[p] for p in opt.param_groups[0]["params"][::2])
    parsed = parse_state_format(fmt)
    assert parsed is not None
    assert big["mixprec.state"] == (LOWBIT_FORMATS.index(fmt), parsed.block)
    for key in ("exp_avg", "exp_avg_sq"):
        assert big[key].dtype == torch.uint8
        assert big[key].numel() == (8192 // 2 if fmt == "int4" else 8192)
        assert big[key + ".absmax"].dtype == torch.float32
        assert small[key].dtype == torch.float32  # 2048 elements: under min_size
    assert "mixprec.state" not in small


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_quantized_run_follows_the_float32_state_run(name: str) -> None:
    batches = _batches(30)
    ref = _train(*_wrapped("O0,state=none", OPTIMIZERS[name]), batches)
    low = _train(*_wrapped("O0,state=int8(min_size=0)", OPTIMIZERS[name]), batches)
    assert abs(low[-1] - ref[-1]) <= 0.03 * ref[-1] + 1e-4
    assert low[-1] < 0.5 * low[0]


def test_state_bytes_per_parameter() -> None:
    model, opt = _wrapped("O0,state=int8(min_size=0)")
    _train(model, opt, _batches(2))
    params = sum(p.numel() for p in model.parameters())
    kept = sum(
        v.numel() * v.element_size()
        for s in opt.state.values()
        for k, v in s.items()
        if isinstance(v, torch.Tensor) and k != "step"
    )
    # two moments, one byte each, plus one float32 absmax per 256 elements (and per bias)
    assert 2.0 <= kept / params <= 2.1
    model4, opt4 = _wrapped("O0,state=int4(min_size=0)")
    _train(model4, opt4, _batches(2))
    kept4 = sum(
        v.numel() * v.element_size()
        for s in opt4.state.values()
        for k, v in s.items()
        if isinstance(v, torch.Tensor) and k != "step"
    )
    assert kept4 / params <= 1.1


@pytest.mark.parametrize("base", ["O0", "O2-bf16", "O3-bf16-sr"])
def test_a_skipped_step_leaves_codes_and_scales_bit_identical(base: str) -> None:
    model, opt = _wrapped(f"{base},state=int8")
    _train(model, opt, _batches(3))
    before = _snapshot(opt)
    weights = [p.detach().clone() for p in model.parameters()]
    x, y = _batches(1, seed=9)[0]
    loss = nn.functional.mse_loss(model(x).float(), y) * float("inf")
    opt.zero_grad()
    with mpt.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    assert mpt.state(opt).skipped_steps == 1
    assert _same(before, _snapshot(opt))
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters(), strict=True))


@pytest.mark.parametrize("fmt", ["int8", "int4(block=64)"])
def test_save_and_resume_is_bit_exact_through_weights_only(fmt: str) -> None:
    policy = f"O2-bf16,state={fmt}"
    batches = _batches(10)
    model, opt = _wrapped(policy)
    _train(model, opt, batches[:5])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    _train(model, opt, batches[5:])

    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model2, opt2 = _wrapped(policy)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    _train(model2, opt2, batches[5:])
    assert _same(_snapshot(opt), _snapshot(opt2))
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    # the checkpoint holds the codes: a quarter of the float32 state's bytes or less
    moments = [v for s in saved["opt"]["state"].values() for k, v in s.items() if k == "exp_avg"]
    assert moments[0].dtype == torch.uint8


def test_checkpoint_of_another_format_is_refused_and_nothing_changes() -> None:
    model, opt = _wrapped("O0,state=int8")
    _train(model, opt, _batches(2))
    sd = opt.state_dict()
    for other in ("O0,state=int4", "O0,state=int8(block=128)", "O0,state=fp8"):
        model2, opt2 = _wrapped(other)
        _train(model2, opt2, _batches(1))
        before = _snapshot(opt2)
        with (
            pytest.raises(CheckpointError, match="float32_state_dict"),
            pytest.warns(MixprecWarning, match="saved under policy"),
        ):
            opt2.load_state_dict(sd)
        assert _same(before, _snapshot(opt2))


def test_damaged_codes_or_scales_are_refused() -> None:
    model, opt = _wrapped("O0,state=int8")
    _train(model, opt, _batches(2))
    sd = opt.state_dict()
    entry = sd["state"][0]
    for key, value in (
        ("exp_avg", entry["exp_avg"][:-3]),
        ("exp_avg.absmax", entry["exp_avg.absmax"][:-1]),
        ("exp_avg", entry["exp_avg"].float()),
    ):
        damaged = {**sd, "state": {**sd["state"], 0: {**entry, key: value}}}
        with pytest.raises(CheckpointError, match=r"does not fit|inf or NaN"):
            opt.load_state_dict(damaged)
    beyond = entry["exp_avg"].clone()
    beyond[7] = 255  # the signed int8 map has 255 values: codes 0..254
    damaged = {**sd, "state": {**sd["state"], 0: {**entry, "exp_avg": beyond}}}
    with pytest.raises(CheckpointError, match="code 255, beyond the 255 values"):
        opt.load_state_dict(damaged)
    nan = entry["exp_avg_sq.absmax"].clone()
    nan[0] = float("nan")
    damaged = {**sd, "state": {**sd["state"], 0: {**entry, "exp_avg_sq.absmax": nan}}}
    with pytest.raises(CheckpointError, match="inf or NaN"):
        opt.load_state_dict(damaged)


def test_float32_checkpoint_loads_into_a_quantized_policy_and_back() -> None:
    batches = _batches(6)
    model, opt = _wrapped("O0")
    _train(model, opt, batches[:3])
    plain = opt.state_dict()
    model_q, opt_q = _wrapped("O0,state=int8")
    model_q.load_state_dict(model.state_dict())
    with pytest.warns(MixprecWarning, match="saved under policy O0"):
        opt_q.load_state_dict(plain)  # encoded on load
    assert opt_q.state[opt_q.param_groups[0]["params"][0]]["exp_avg"].dtype == torch.uint8
    _train(model_q, opt_q, batches[3:])

    out = mpt.float32_state_dict(opt_q)  # the way back: float32 of the parameters' shapes
    bare = _net()
    bare_opt = torch.optim.AdamW(bare.parameters(), lr=1e-3)
    bare_opt.load_state_dict({k: v for k, v in out.items() if k != "mixprec"})
    for p, state in zip(bare.parameters(), bare_opt.state.values(), strict=True):
        assert state["exp_avg"].shape == p.shape and state["exp_avg"].dtype == torch.float32
    # the decoded state is what the codes hold
    fmt = parse_state_format("int8")
    assert fmt is not None
    q_state = opt_q.state[opt_q.param_groups[0]["params"][0]]
    decoded = dequantize(q_state["exp_avg"], q_state["exp_avg.absmax"], fmt, True, 8192)
    assert torch.equal(out["state"][0]["exp_avg"].reshape(-1), decoded)
    with pytest.raises(WrapError, match="not wrapped with a policy whose state"):
        mpt.float32_state_dict(opt)


def test_keep_and_min_size_keep_float32_state() -> None:
    model, opt = _wrapped("O0,state=int8(min_size=0,keep=2.*)")
    _train(model, opt, _batches(2))
    params = opt.param_groups[0]["params"]
    assert opt.state[params[0]]["exp_avg"].dtype == torch.uint8  # 0.weight
    assert opt.state[params[1]]["exp_avg"].dtype == torch.uint8  # 0.bias: min_size=0
    assert opt.state[params[2]]["exp_avg"].dtype == torch.float32  # 2.weight: kept
    assert opt.state[params[3]]["exp_avg"].dtype == torch.float32


def test_unsupported_optimizer_is_refused_before_anything_changes() -> None:
    model = _net()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(WrapError, match="Adam, AdamW and SGD"):
        mpt.wrap(model, opt, policy="O2-bf16,state=int8")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters(), strict=True))
    assert not hasattr(opt, "_mixprec")


def test_plain_sgd_has_nothing_to_quantize() -> None:
    model, opt = _wrapped("O0,state=int8", lambda p: torch.optim.SGD(p, lr=0.05))
    losses = _train(model, opt, _batches(5))
    assert losses[-1] < losses[0]
    assert all("mixprec.state" not in s for s in opt.state.values())


def test_a_non_finite_moment_is_refused_and_the_codes_stay() -> None:
    model, opt = _wrapped("O0,state=int8")
    _train(model, opt, _batches(2))
    quantized = opt.state[opt.param_groups[0]["params"][0]]
    before = {k: v.clone() for k, v in quantized.items() if k.startswith("exp_avg")}
    opt.param_groups[0]["betas"] = (0.9, float("inf"))  # v * beta2 overflows
    with pytest.raises(PolicyError, match=r"inf or NaN.*keep=0\.weight"):
        _train(model, opt, _batches(1, seed=5))
    assert len(before) == 4  # exp_avg, exp_avg_sq and their absmax
    assert all(torch.equal(v, quantized[k]) for k, v in before.items())


def test_clipping_after_unscale_works_with_quantized_state() -> None:
    model, opt = _wrapped("O2-bf16,state=int8")
    for x, y in _batches(5):
        loss = nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad()
        with mpt.scale_loss(loss, opt) as scaled:
            scaled.backward()
        mpt.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(mpt.master_params(opt), 0.01)
        opt.step()
    assert mpt.state(opt).skipped_steps == 0
    assert opt.state[opt.param_groups[0]["params"][0]]["exp_avg"].dtype == torch.uint8


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_codec_round_trip_is_a_fixed_point_and_keeps_the_absmax(fmt: str) -> None:
    parsed = parse_state_format(f"{fmt}(block=32)")
    assert parsed is not None
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * torch.logspace(-8, 2, 1000)
    x[128:160] = 0.0  # a whole block of zeros
    for signed in (True, False):
        value = x if signed else x.abs()
        codes, scale = quantize(value, parsed, signed)
        decoded = dequantize(codes, scale, parsed, signed, value.numel())
        again = dequantize(*quantize(decoded, parsed, signed), parsed, signed, value.numel())
        assert torch.equal(decoded, again)
        blocks = torch.nn.functional.pad(value, (0, 24)).abs().view(-1, 32)
        assert torch.equal(scale, blocks.amax(1))
        assert torch.equal(decoded[128:160], torch.zeros(32))
        assert torch.equal(quantize(decoded, parsed, signed)[0], codes)


def test_policy_text_and_explain_name_the_state() -> None:
    policy = mixprec.get_policy("O2-bf16,state=int4(block=64,keep=*embed*)")
    assert policy.state == "int4(block=64,keep=*embed*)"
    assert "one float32 absmax per 64 elements" in policy.describe_state()
    with pytest.raises(PolicyError, match="power of two"):
        mixprec.get_policy("O2,state=int8(block=100)")
    with pytest.raises(PolicyError, match="no master"):
        mixprec.get_policy("O3,state=int8")


def test_the_guides_example_runs_as_shown(tmp_path: Any, monkeypatch: Any) -> None:
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[2] / "docs" / "guide.md").read_text()
    code = guide.split("<!-- lowbit example -->\n```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    printed: list[str] = []
    exec(compile(code, "guide.md", "exec"), {"print": lambda *a: printed.append(str(a))})
    assert printed == ["(torch.uint8, torch.Size([64]))"]
    sd = torch.load(tmp_path / "opt.pt", weights_only=True)
    assert sd["state"][0]["mixprec.state"] == (0, 256)
