"""The low-bit state's CPU kernels (issue 35, item 2): the block-wise codec and the fused step.

The C codec gives the torch twin's codes, absmax and decoded values bit for bit on every
format and map (odd lengths, partial last blocks, zeros, values exactly on a midpoint and one
ulp either side, subnormals, inf and NaN), and says in the same pass whether every absmax is
finite. The fused step (one pass per tensor) gives its twin's bits, follows the generic path
(torch's own AdamW/Adam/SGD over decoded state) to float32 rounding, is taken exactly where
it qualifies, keeps float32-kept parameters and the first step right, and never overwrites
codes with a non-finite moment. ``make sanitize`` runs this file against an AddressSanitizer
and UBSan build (tests/torch/test_native_delivery.py).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import mixprec.torch as mpt  # noqa: E402
from mixprec.kit import StateFormat, parse_state_format, state_map  # noqa: E402
from mixprec_torch.cpu import clib  # noqa: E402
from mixprec_torch.cpu.update_rule import hyper  # noqa: E402
from mixprec_torch.lowbit import codec, fused_step  # noqa: E402

pytestmark = pytest.mark.torch

needs_native = pytest.mark.skipif(clib.library() is None, reason=f"native kernels: {clib.status()}")

FORMATS = ["int8", "int4", "fp8"]


def _fmt(text: str) -> StateFormat:
    parsed = parse_state_format(text)
    assert parsed is not None
    return parsed


class _Twin:
    """Runs a function with the kernels switched off (as ``MIXPREC_NATIVE=0``)."""

    def __enter__(self) -> None:
        self.saved = dict(clib._state)
        clib._state.clear()
        clib._state.update({"lib": None, "reason": "switched off by a test"})

    def __exit__(self, *exc: object) -> None:
        clib._state.clear()
        clib._state.update(self.saved)


def _same_bits(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    x, y = a.detach().reshape(-1), b.detach().reshape(-1)
    if x.dtype == torch.float32:
        x, y = x.view(torch.int32), y.view(torch.int32)
    diff = (x != y).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.numel()} differ, first at {diff[:5].tolist()}"


def _tricky(fmt: StateFormat, signed: bool, n: int, seed: int) -> torch.Tensor:
    """Values that hit the codec's edges: every midpoint exactly and one ulp either side (in
    blocks whose absmax is 1, so n = x), zeros and -0, a block of zeros, subnormals, and
    ordinary values over many decades."""
    g = torch.Generator().manual_seed(seed)
    x = (
        torch.randn(n, generator=g)
        * torch.logspace(-9, 0, n).flip(0)[torch.randperm(n, generator=g)]
    )
    mids = torch.tensor(state_map(fmt.name, signed).mids, dtype=torch.float32)
    edges = torch.cat([mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    block = fmt.block
    for start in range(0, min(n, 4 * block), block):  # a few blocks of exact midpoints
        stop = min(start + block, n)
        take = edges[torch.randint(0, edges.numel(), (stop - start,), generator=g)]
        x[start:stop] = take.clamp(-1.0, 1.0)
        x[start] = 1.0  # the block's absmax: n is x itself
    if n > 6 * block:
        x[4 * block : 5 * block] = 0.0  # a block of zeros
        x[5 * block : 5 * block + 8] = torch.tensor(
            [1e-45, -1e-40, 3e-39, -0.0, 0.0, 1e-38, 2e-45, -7e-42]
        )
    if n > 7 * block:
        x[6 * block : 7 * block] *= 1e-38  # a block whose absmax is (nearly) subnormal
    return x if signed else x.abs()


# ------------------------------------------------------------------ the codec


@needs_native
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("block", [32, 128, 4096])
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_the_codec_gives_the_twins_bits(name: str, block: int, signed: bool) -> None:
    fmt = _fmt(f"{name}(block={block})")
    for n in (0, 1, 2, 31, 33, block - 1, block + 1, 3 * block + 7, 9 * block + 1, 20001):
        x = _tricky(fmt, signed, n, seed=n)
        codes, scale, finite = codec.encode(x, fmt, signed)
        twin_codes, twin_scale = codec.quantize_torch(x, fmt, signed)
        assert finite is True
        _same_bits(codes, twin_codes, f"codes n={n}")
        _same_bits(scale, twin_scale, f"absmax n={n}")
        assert codes.numel() == codec.code_count(fmt, n)
        if fmt.bits == 4 and n % 2:
            assert int(codes[-1]) >> 4 == 0, "the nibble after an odd last element is 0"
        decoded = codec.dequantize(codes, scale, fmt, signed, n)
        _same_bits(decoded, codec.dequantize_torch(codes, scale, fmt, signed, n), f"values n={n}")


@needs_native
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_the_search_index_answers_as_the_binary_search_over_all_of_float32(
    name: str, signed: bool
) -> None:
    """Every 509th float32 bit pattern in [-1, 1] (subnormals, zeros and both signs
    included), each in a block whose absmax is 1: the codes are torch.searchsorted's."""
    fmt = _fmt(f"{name}(block=4096)")
    bits = torch.arange(0, 0x3F800000, 509, dtype=torch.int64).to(torch.int32)
    values = bits.view(torch.float32)
    x = torch.cat([values, -values]) if signed else values
    pad = (-x.numel()) % (fmt.block - 1)
    x = torch.cat([x, torch.zeros(pad)]).view(-1, fmt.block - 1)
    x = torch.cat([torch.ones(x.shape[0], 1), x], dim=1).reshape(-1)
    codes, _, _ = codec.encode(x, fmt, signed)
    mids = torch.tensor(state_map(fmt.name, signed).mids, dtype=torch.float32)
    expected = torch.searchsorted(mids, x).to(torch.uint8)
    if fmt.bits == 4:
        expected = expected[0::2] | (expected[1::2] << 4)
    _same_bits(codes, expected, "codes")


@needs_native
@pytest.mark.parametrize("name", FORMATS)
def test_a_non_finite_block_is_reported_in_the_same_pass(name: str) -> None:
    fmt = _fmt(f"{name}(block=32)")
    for bad in (float("inf"), float("-inf"), float("nan")):
        x = torch.randn(100)
        x[70] = bad
        codes, scale, finite = codec.encode(x, fmt, True)
        twin_codes, twin_scale = codec.quantize_torch(x, fmt, True)
        assert finite is False
        with _Twin():
            assert not bool(codec.encode(x, fmt, True)[2])
        _same_bits(codes, twin_codes, "codes of a non-finite block")
        assert torch.equal(scale.isnan(), twin_scale.isnan())
        assert torch.equal(scale[~scale.isnan()], twin_scale[~twin_scale.isnan()])
        assert math.isinf(scale[2]) or math.isnan(scale[2])
    codes, scale, finite = codec.encode(torch.randn(100), fmt, True)
    assert finite is True


@needs_native
def test_a_code_the_map_lacks_decodes_as_nan_in_the_kernels() -> None:
    """Damaged codes never read outside the map (fp8's signed map has 253 values)."""
    fmt = _fmt("fp8(block=32)")
    codes = torch.full((64,), 255, dtype=torch.uint8)
    values = codec.dequantize(codes, torch.ones(2), fmt, True, 64)
    assert values.isnan().all()
    with pytest.raises(IndexError):
        codec.dequantize_torch(codes, torch.ones(2), fmt, True, 64)


@needs_native
def test_dequantize_writes_into_out_of_any_layout() -> None:
    fmt = _fmt("int8(block=32)")
    x = torch.randn(12, 10)
    codes, scale = codec.quantize(x, fmt, True)
    out = torch.empty(10, 12).t()  # not contiguous
    got = codec.dequantize(codes, scale, fmt, True, x.numel(), out=out)
    assert got is out
    _same_bits(out, codec.dequantize_torch(codes, scale, fmt, True, x.numel()).view(12, 10))


@needs_native
def test_the_codec_splits_work_between_threads_without_changing_a_bit() -> None:
    fmt = _fmt("int4(block=128)")
    x = torch.randn(600_003)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = codec.encode(x, fmt, True)
        torch.set_num_threads(2)
        two = codec.encode(x, fmt, True)
    finally:
        torch.set_num_threads(before)
    _same_bits(one[0], two[0])
    _same_bits(one[1], two[1])


# ------------------------------------------------------------------ the fused step

Make = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class _AdamW(torch.optim.AdamW):
    """AdamW under another class: the generic path (widen, torch's own step, narrow)."""


class _Adam(torch.optim.Adam):
    pass


class _SGD(torch.optim.SGD):
    pass


OPTIMIZERS: dict[str, tuple[Make, Make]] = {  # (fused, generic)
    "adamw": (
        lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.05),
        lambda p: _AdamW(p, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.05),
    ),
    "adam-l2-maximize": (
        lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=1e-2, maximize=True),
        lambda p: _Adam(p, lr=1e-2, weight_decay=1e-2, maximize=True),
    ),
    "sgd-nesterov": (
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
        lambda p: _SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    ),
    "sgd-dampening": (
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, dampening=0.3),
        lambda p: _SGD(p, lr=0.05, momentum=0.8, dampening=0.3),
    ),
    "sgd-plain": (
        lambda p: torch.optim.SGD(p, lr=0.05),
        lambda p: _SGD(p, lr=0.05),
    ),
}


def _net() -> nn.Module:
    """A quantized weight of an odd size (37 * 131), a small float32-kept one (131), one kept
    by name (``keep=2.*``), and one that never gets a gradient."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(37, 131), nn.Tanh(), nn.Linear(131, 29), nn.Linear(29, 3))
    net.unused = nn.Linear(3, 40)  # type: ignore[assignment]
    return net


@pytest.fixture
def fused_runs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many steps took the fused path."""
    runs: list[int] = []
    original = fused_step.run

    def counted(optimizer: Any, plan: Any) -> Any:
        runs.append(1)
        return original(optimizer, plan)

    monkeypatch.setattr(fused_step, "run", counted)
    yield runs


def _train(policy: str, make: Make, steps: int = 3) -> tuple[list[torch.Tensor], Any]:
    """The model's weights and the optimizer after ``steps`` steps."""
    net = _net()
    model, opt = mpt.wrap(net, make(list(net.parameters())), policy=policy)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 37, generator=g)
        loss = model(x).float().square().mean()
        opt.zero_grad()
        with mpt.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt


def _state(opt: Any) -> list[tuple[str, Any]]:
    """Every entry of the optimizer's state dict, as (``<param index>.<key>``, value)."""
    return [
        (f"{i}.{k}", v) for i, s in opt.state_dict()["state"].items() for k, v in sorted(s.items())
    ]


POLICIES = ["O0,state={}(block=32)", "O2,state={}", "O2-bf16,state={}(min_size=0,keep=2.*)"]


@needs_native
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_the_fused_step_gives_its_twins_bits(
    name: str, policy: str, opt_name: str, fused_runs: list[int]
) -> None:
    make = OPTIMIZERS[opt_name][0]
    native, native_opt = _train(policy.format(name), make)
    assert len(fused_runs) == 3, "the fused step ran"
    with _Twin():
        twin, twin_opt = _train(policy.format(name), make)
    assert len(fused_runs) == 6, "the twin's fused step ran"
    for i, (a, b) in enumerate(zip(native, twin, strict=True)):
        _same_bits(a, b, f"weight {i}")
    state, twin_state = _state(native_opt), _state(twin_opt)
    assert [k for k, _ in state] == [k for k, _ in twin_state]
    for (key, a), (_, b) in zip(state, twin_state, strict=True):
        if isinstance(a, torch.Tensor):
            _same_bits(a, b, key)
        else:
            assert a == b, key


def _ulps_apart(a: torch.Tensor, b: torch.Tensor, scale: float) -> float:
    """The largest |a - b| in float32 ulps of max(|b|, scale) (the update's own size)."""
    a, b = a.detach().float(), b.detach().float()
    size = torch.maximum(b.abs(), torch.tensor(scale))
    return float(((a - b).abs() / (size * torch.finfo(torch.float32).eps)).max())


@needs_native
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("policy", ["O0,state=int8(min_size=0)", "O2,state=int4"])
def test_the_fused_step_follows_the_generic_path(
    opt_name: str, policy: str, fused_runs: list[int]
) -> None:
    """One step from no state: the weights within a few ulps of torch's own optimizer over
    decoded state, nearly every code the same. Five steps: no weight further apart than a few
    learning rates, and under O0 nearly every one still to float32 rounding (a moment a few
    ulps off may cross a midpoint, one code apart; under O2 a master one ulp apart may round
    to another float16 weight, and the gradients part)."""
    fused, generic = OPTIMIZERS[opt_name]
    _, a_opt = _train(policy, fused, steps=1)
    _, b_opt = _train(policy, generic, steps=1)
    assert len(fused_runs) == 1, "only the first run took the fused path"
    masters = zip(mpt.master_params(a_opt), mpt.master_params(b_opt), strict=True)
    for x, y in masters:  # float32 (O2's model weights are their float16 roundings)
        assert _ulps_apart(x, y, 1e-2) <= 4
    codes = [
        (k, v) for k, v in _state(a_opt) if isinstance(v, torch.Tensor) and v.dtype == torch.uint8
    ]
    other = dict(_state(b_opt))
    same = sum(int((v == other[k]).sum()) for k, v in codes)
    total = sum(v.numel() for _, v in codes)
    assert total == 0 or same >= 0.99 * total
    _, a_opt = _train(policy, fused, steps=5)
    _, b_opt = _train(policy, generic, steps=5)
    lr = a_opt.param_groups[0]["lr"]
    close = total = 0
    for x, y in zip(mpt.master_params(a_opt), mpt.master_params(b_opt), strict=True):
        diff = (x.detach() - y.detach()).abs()
        assert float(diff.max()) <= 5 * lr
        close += int((diff <= 1e-5 * y.detach().abs() + 1e-6).sum())
        total += diff.numel()
    assert close >= 0.99 * total or not policy.startswith("O0")


@needs_native
def test_the_fused_step_uses_threads_without_changing_a_bit() -> None:
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            net = nn.Linear(700, 600)
            with torch.no_grad():
                net.weight.copy_(torch.linspace(-1, 1, 420_000).view(600, 700))
            _, opt = mpt.wrap(
                net, torch.optim.AdamW(net.parameters(), lr=1e-3), policy="O0,state=int8(block=64)"
            )
            g = torch.Generator().manual_seed(0)
            for _ in range(2):
                for p in net.parameters():
                    p.grad = torch.randn(p.shape, generator=g)
                opt.step()
            results.append([net.weight.detach().clone(), *[v for _, v in _state(opt)]])
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*results, strict=True):
        if isinstance(a, torch.Tensor):
            _same_bits(a, b)


def _set(opt: torch.optim.Optimizer, **options: Any) -> torch.optim.Optimizer:
    opt.param_groups[0].update(options)  # past the constructor's checks, as a scheduler may
    return opt


@pytest.mark.parametrize(
    ("make", "key"),
    [
        (lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True), "exp_avg"),
        (lambda p: _AdamW(p, lr=1e-2), "exp_avg"),
        (
            lambda p: _set(torch.optim.SGD(p, lr=0.05, momentum=0.5), momentum=1.5),
            "momentum_buffer",
        ),
        (lambda p: _set(torch.optim.Adam(p, lr=1e-2), betas=(0.9, 1.0)), "exp_avg"),
    ],
    ids=["amsgrad", "subclass", "momentum-over-1", "beta2-of-1"],
)
def test_what_the_fused_step_does_not_take_trains_on_the_generic_path(
    make: Make, key: str, fused_runs: list[int]
) -> None:
    _, opt = _train("O0,state=int8", make, steps=2)
    assert fused_runs == []
    assert opt.state[opt.param_groups[0]["params"][0]][key].dtype == torch.uint8


def test_a_closure_takes_the_generic_path(fused_runs: list[int]) -> None:
    net = _net()
    model, opt = mpt.wrap(net, torch.optim.AdamW(net.parameters(), lr=1e-2), policy="O0,state=int8")
    x = torch.randn(4, 37)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).float().square().mean()
        loss.backward()
        return loss

    closure()
    opt.step(closure)
    assert fused_runs == []
    assert opt.state[net[0].weight]["exp_avg"].dtype == torch.uint8


def test_a_gradient_beyond_the_bound_takes_the_generic_path(fused_runs: list[int]) -> None:
    """A gradient of 5e18 (its square finite, so the guard lets the step through) is past
    GRAD_BOUND: the generic path runs it; one of 1e17 takes the fused path."""
    for big, fused in ((1e17, True), (5e18, False)):
        fused_runs.clear()
        net = _net()
        _, opt = mpt.wrap(
            net, torch.optim.SGD(net.parameters(), lr=1e-30, momentum=0.5), policy="O0,state=int8"
        )
        for p in net.parameters():
            p.grad = torch.zeros_like(p)
        net[0].weight.grad[0, 0] = big
        opt.step()
        assert fused_runs == ([1] if fused else [])
        assert opt.state[net[0].weight]["momentum_buffer"].dtype == torch.uint8


def test_the_step_hooks_run_once_around_the_fused_step(fused_runs: list[int]) -> None:
    net = _net()
    model, opt = mpt.wrap(net, torch.optim.AdamW(net.parameters(), lr=1e-2), policy="O0,state=int8")
    seen: list[str] = []
    opt.register_step_pre_hook(lambda *a: seen.append("pre"))
    opt.register_step_post_hook(lambda *a: seen.append("post"))
    loss = model(torch.randn(4, 37)).float().square().mean()
    with mpt.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    assert fused_runs == [1]
    assert seen == ["pre", "post"]


@needs_native
def test_the_kernel_keeps_the_codes_of_a_block_whose_new_state_is_not_finite() -> None:
    """What the plan's bounds rule out, called directly: a beta2 of inf makes every new
    exp_avg_sq inf; those blocks keep their codes and absmax, the tensor is flagged, and the
    twin does the same."""
    fmt = _fmt("int8(block=32)")
    results = []
    for native in (True, False):
        g = torch.Generator().manual_seed(0)
        w = torch.randn(100, generator=g)
        grad = torch.randn(100, generator=g)
        m_codes, m_scale = codec.quantize_torch(torch.randn(100, generator=g), fmt, True)
        v_codes, v_scale = codec.quantize_torch(torch.rand(100, generator=g), fmt, False)
        state = {"exp_avg": m_codes, "exp_avg_sq": v_codes, "exp_avg.absmax": m_scale}
        state["exp_avg_sq.absmax"] = v_scale
        before = {k: v.clone() for k, v in state.items()}
        group = {"lr": 1e-3, "betas": (0.9, float("inf")), "eps": 1e-8, "weight_decay": 0.0}
        item = fused_step._Item(w, grad, True, step_size=1e-3, inv_bc2=1.0)
        item.moments = [
            fused_step.Moment(state, "exp_avg", True, m_codes, m_scale, False),
            fused_step.Moment(state, "exp_avg_sq", False, v_codes, v_scale, False),
        ]
        p = fused_step.Plan(1, fmt, (0, 32), [])
        if native:
            lib = clib.library()
            assert lib is not None
            flags = fused_step._run_lowbit_native(lib, [item], hyper(group, 1), p)
        else:
            flags = fused_step._run_torch([item], hyper(group, 1), p)
        assert flags == [2], "exp_avg_sq is flagged, exp_avg is not"
        assert torch.equal(state["exp_avg_sq"], before["exp_avg_sq"])
        assert torch.equal(state["exp_avg_sq.absmax"], before["exp_avg_sq.absmax"])
        assert not torch.equal(state["exp_avg"], before["exp_avg"])
        results.append([w, *state.values()])
    for a, b in zip(*results, strict=True):
        _same_bits(a, b)


def test_the_plan_changes_nothing_and_the_first_step_makes_the_state(fused_runs: list[int]) -> None:
    net = _net()
    _, opt = mpt.wrap(net, torch.optim.Adam(net.parameters(), lr=1e-2), policy="O0,state=fp8")
    lowbit = opt._mixprec.group.lowbit
    for p in net[:4].parameters():  # net.unused gets none
        p.grad = torch.ones_like(p)
    assert fused_step.plan(opt, lowbit.fmt, lowbit.tag, lowbit._quantized) is not None
    assert len(opt.state) == 0
    opt.step()
    big, small = opt.state[net[0].weight], opt.state[net[0].bias]
    assert list(big) == [
        "step",
        "exp_avg",
        "exp_avg_sq",
        "exp_avg.absmax",
        "mixprec.state",
        "exp_avg_sq.absmax",
    ]
    assert big["exp_avg"].dtype == torch.uint8 and float(big["step"]) == 1.0
    assert small["exp_avg"].dtype == torch.float32
    assert net.unused.weight not in opt.state or not opt.state[net.unused.weight]


# ------------------------------------------------------------------ the guard's read, shared


@pytest.fixture
def grad_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[torch.Tensor]]:
    """The tensors clib.max_abs read (held: no id is reused)."""
    seen: list[torch.Tensor] = []
    original = clib.max_abs

    def recorded(lib: Any, tensors: list[torch.Tensor]) -> float:
        seen.extend(tensors)
        return original(lib, tensors)

    monkeypatch.setattr(clib, "max_abs", recorded)
    yield seen


def _read(reads: list[torch.Tensor], opt: torch.optim.Optimizer) -> bool:
    """Whether one of the optimizer's gradients now is among ``reads``."""
    grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
    return any(t is g for t in reads for g in grads)


@needs_native
def test_the_guards_pass_is_the_only_read_of_the_gradients(
    fused_runs: list[int], grad_reads: list[torch.Tensor]
) -> None:
    """Under O0 the guard's sum of squares proves the bound: after the first step (which
    asks the guard to keep it) the plan reads no gradient (only the moments' absmax); the
    bits are those of the step that reads them (the twin's)."""
    native, opt = _train("O0,state=int8(block=32)", OPTIMIZERS["adamw"][0])
    assert len(fused_runs) == 3
    assert grad_reads and not _read(grad_reads, opt), "a gradient was read again"
    with _Twin():
        twin, _ = _train("O0,state=int8(block=32)", OPTIMIZERS["adamw"][0])
    for i, (a, b) in enumerate(zip(native, twin, strict=True)):
        _same_bits(a, b, f"weight {i}")


@needs_native
def test_a_sum_of_squares_that_proves_no_bound_reads_the_gradients(
    fused_runs: list[int], grad_reads: list[torch.Tensor]
) -> None:
    """Four gradients of 9e17: each within GRAD_BOUND, their sum of squares (3.2e36) not a
    proof of it, so the plan reads them, and the step is fused."""
    net = _net()
    _, opt = mpt.wrap(
        net, torch.optim.SGD(net.parameters(), lr=1e-30, momentum=0.5), policy="O0,state=int8"
    )
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # the first asks the guard to keep its sum
    net[0].weight.grad[0, :4] = 9e17
    grad_reads.clear()
    opt.step()
    assert fused_runs == [1, 1]
    assert _read(grad_reads, opt)


@needs_native
def test_the_guards_sum_is_taken_once_and_only_for_the_gradients_it_read() -> None:
    from mixprec_torch.cpu.grad_check import GuardPlan, native_unscale

    lib = clib.library()
    net = nn.Linear(5, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for p in net.parameters():
        p.grad = torch.full_like(p, 2.0)
    plan = GuardPlan(None, opt, {})
    grads = [net.weight.grad, net.bias.grad]
    assert native_unscale(lib, plan, None, False, lambda g, m: ([], [])) is False
    assert plan.squares_of(grads) is None, "kept only where asked"
    plan.keep_squares = True

    def read(inv_scale: float | None = None) -> None:
        assert native_unscale(lib, plan, inv_scale, False, lambda g, m: ([], [])) is False

    read()
    assert plan.squares_of(grads) == 4.0 * 18
    assert plan.squares_of(grads) is None, "taken once"
    read()
    assert plan.squares_of([net.weight.grad]) == 4.0 * 18, "a part of what it read"
    read()
    net.bias.grad.mul_(0.5)  # written in place since the pass
    assert plan.squares_of(grads) is None
    read()
    assert plan.squares_of(grads) == 4.0 * 15 + 3.0
    read()
    assert plan.squares_of([torch.ones(3)]) is None, "a tensor it did not read"
    read(inv_scale=0.5)  # an unscale writes the gradients: no sum left
    assert plan.squares_of(grads) is None
    read()
    gone = weakref.ref(net.bias.grad)
    del grads
    net.bias.grad = None
    assert gone() is None, "the kept sum holds no gradient alive"
    assert plan.squares_of([net.weight.grad]) == 15 + 3 * 0.25  # as the unscale left them
