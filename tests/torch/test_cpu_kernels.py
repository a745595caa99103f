"""The native CPU kernels (mixprec_torch.cpu.clib) and their torch fallbacks.

Where the kernels are not there (an install without them, MIXPREC_NATIVE=0), every caller uses
torch operations instead; these tests check that both give the same bits (the guard's pass, the
fused compensated update, the stochastic-rounding noise, on any device), that the fused update
follows torch's own SGD, Adam and AdamW and takes only the group options it honours, and that
the library in use runs the best clone of its loops this CPU supports. How the library is
delivered and what the loader refuses: test_native_delivery.py. ``make sanitize`` runs this
file against an AddressSanitizer and UBSan build of the kernels.
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import pytest

torch = pytest.importorskip("torch")

from _torch_nets import TANH_X, TANH_Y, tanh_net, train_tanh  # noqa: E402
from torch import nn  # noqa: E402

import mixprec  # noqa: E402
from mixprec_torch.cpu import clib, noise  # noqa: E402

pytestmark = pytest.mark.torch

needs_native = pytest.mark.skipif(clib.library() is None, reason=f"native kernels: {clib.status()}")


@pytest.fixture
def without_native(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The torch fallbacks, as on a machine without a C compiler."""
    monkeypatch.setattr(clib, "_state", {"lib": None, "reason": "switched off by a test"})
    yield


def _swap_native(off: bool) -> dict[str, object]:
    saved = dict(clib._state)
    if off:
        clib._state.clear()
        clib._state.update({"lib": None, "reason": "switched off by a test"})
    return saved


def _run(fn: Callable[[], list[torch.Tensor]], *, off: bool) -> list[torch.Tensor]:
    saved = _swap_native(off)
    try:
        return fn()
    finally:
        clib._state.clear()
        clib._state.update(saved)


def _bits_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.dtype == y.dtype and x.shape == y.shape, i
        x, y = x.detach().reshape(-1), y.detach().reshape(-1)
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), i


def _odd_net(seed: int) -> nn.Module:
    """Weights with subnormal, tie and tiny values, sizes that no vector width divides."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(6, 37), nn.Tanh(), nn.Linear(37, 3))
    with torch.no_grad():
        w = net[0].weight
        w[0, :3] = torch.tensor([1e-40, -3e-39, 2**-130])  # float32 subnormals
        w[1, :2] = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8])  # bfloat16 ties
    return net


OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05),
    "sgd-momentum-wd": lambda p: torch.optim.SGD(
        p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-2
    ),
    "sgd-nesterov-maximize": lambda p: torch.optim.SGD(
        p, lr=0.05, momentum=0.9, nesterov=True, maximize=True
    ),
    "adam-wd": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.8, 0.99)),
}
POLICIES = [
    "O3-bf16-kahan",
    "O3-bf16-sr",
    "O3-bf16-kahan,state=bfloat16",
    "O3-bf16-sr,state=bfloat16",
]


def _trained(
    policy: str, make: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
) -> Callable[[], list[torch.Tensor]]:
    def run() -> list[torch.Tensor]:
        net = _odd_net(0)
        model, opt = mixprec.torch.wrap(net, make(list(net.parameters())), policy=policy, seed=2)
        train_tanh_wide(model, opt, 4)
        opt.zero_grad()
        nn.functional.cross_entropy(model(TANH_X).float(), TANH_Y).backward()
        mixprec.torch.unscale_(opt)  # float32 master gradients this time
        opt.step()
        sd = opt.state_dict()
        state = [v for s in sd["state"].values() for v in s.values()]
        comp = sd["mixprec"]["compensation"]["compensation"]
        return [*model.parameters(), *comp, *state]

    return run


def train_tanh_wide(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(TANH_X).float(), TANH_Y).backward()
        opt.step()


@needs_native
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("make", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_fused_update_native_and_fallback_agree_bit_for_bit(
    policy: str, make: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
) -> None:
    run = _trained(policy, make)
    _bits_equal(_run(run, off=False), _run(run, off=True))


class _Generic(torch.optim.AdamW):
    """AdamW under another class: the generic path (torch's own update on float32 masters)."""


class _GenericSGD(torch.optim.SGD):
    pass


@pytest.mark.parametrize(
    ("fused", "generic"),
    [
        (OPTIMIZERS["adamw"], lambda p: _Generic(p, lr=1e-2, betas=(0.8, 0.99))),
        (
            OPTIMIZERS["sgd-nesterov-maximize"],
            lambda p: _GenericSGD(p, lr=0.05, momentum=0.9, nesterov=True, maximize=True),
        ),
        (
            OPTIMIZERS["sgd-momentum-wd"],
            lambda p: _GenericSGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-2),
        ),
        (
            OPTIMIZERS["adam-wd"],
            lambda p: type("_GenericAdam", (torch.optim.Adam,), {})(p, lr=1e-2, weight_decay=1e-2),
        ),
    ],
    ids=["adamw", "sgd-nesterov-maximize", "sgd-momentum-wd", "adam-wd"],
)
def test_the_fused_update_follows_torchs_optimizers(
    fused: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    generic: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
) -> None:
    """The fused update applies torch's update rule: w + c after 10 kahan steps matches the
    generic path (torch's own optimizer on float32 masters) to float32 rounding."""
    results = []
    for make in (fused, generic):
        net = tanh_net()
        model, opt = mixprec.torch.wrap(net, make(list(net.parameters())), policy="O3-bf16-kahan")
        train_tanh(model, opt, 10)
        results.append(list(model.state_dict().values()))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@needs_native
@pytest.mark.parametrize("policy", ["O1", "O2", "O2-bf16", "O3-bf16", "O3-bf16-kahan"])
def test_the_guard_pass_native_and_fallback_agree(policy: str) -> None:
    """Same unscaled gradients, masters, weights and skip decisions with the native pass
    and with torch's kernels, a huge loss and a NaN gradient included."""

    def run() -> list[torch.Tensor]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 5))
        model, opt = mixprec.torch.wrap(
            net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), policy=policy
        )
        seen = []
        for step in range(6):
            opt.zero_grad()
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
            loss = model(x).float().square().mean() * (1e30 if step == 2 else 1.0)
            with mixprec.torch.scale_loss(loss, opt) as s:
                s.backward()
            if step == 4:
                next(model.parameters()).grad.view(-1)[0] = float("nan")
            if step % 2:
                mixprec.torch.unscale_(opt)
                seen += [p.grad.clone() for p in mixprec.torch.master_params(opt)]
            opt.step()
        assert mixprec.torch.state(opt).skipped_steps == 2  # the huge loss, the NaN
        return [*seen, *model.parameters(), *mixprec.torch.master_params(opt)]

    _bits_equal(_run(run, off=False), _run(run, off=True))


@needs_native
def test_noise_native_and_torch_agree() -> None:
    lib = clib.library()
    assert lib is not None
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        key = int(torch.randint(0, 2**62, (1,), generator=gen)) * 3
        index = int(torch.randint(0, 10**7, (1,), generator=gen))
        count = int(torch.randint(0, 3000, (1,), generator=gen))
        assert torch.equal(
            clib.noise(lib, key, index, count), noise._noise_torch(key, index, count)
        )
    work = torch.randn(100_003)
    other = work.clone()
    noise.round_stochastic_(work, 77, index=5)
    saved = _swap_native(True)
    try:
        noise.round_stochastic_(other, 77, index=5)
    finally:
        clib._state.clear()
        clib._state.update(saved)
    assert torch.equal(work, other)
    assert torch.equal(work, work.to(torch.bfloat16).float())  # on the bfloat16 grid


def test_stochastic_rounding_is_unbiased(without_native: None) -> None:
    value = 1.0 + 2**-10  # an eighth of the way from 1 to the next bfloat16 (1 + 2**-7)
    work = torch.full((1 << 16,), value)
    noise.round_stochastic_(work, noise.pass_key(3, 0, 0))
    assert set(work.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert float(work.double().mean()) == pytest.approx(
        value, abs=4 * 2**-7 * (7 / 64 / 2**16) ** 0.5
    )


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


@needs_native
@pytest.mark.skipif(
    platform.machine() != "x86_64" or not sys.platform.startswith("linux"),
    reason="the ISA clones are built for x86-64 Linux",
)
def test_the_library_runs_the_best_clone_this_cpu_supports() -> None:
    """The library carries AVX-512, AVX2 and baseline clones of its hot loops (no
    -march=native) and the resolver's pick follows the CPU's flags (on an AVX2-only CPU:
    avx2)."""
    found = clib.info()
    assert found.clones == "avx512f,avx2,default"
    flags = _cpu_flags()
    expected = "avx512f" if "avx512f" in flags else "avx2" if "avx2" in flags else "default"
    assert found.isa == expected, found.describe()


def test_the_noise_twin_gives_the_c_bits_on_any_device() -> None:
    """The twin's int64 arithmetic (wraparound, masked shifts) gives the C's bits, wherever
    it runs: checked against the library on the CPU, and shape-for-shape on the meta
    device, where no value ever reaches the host."""
    lib = clib.library()
    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        key = int(torch.randint(0, 2**62, (1,), generator=gen)) * 3 + 1  # high bits set too
        index = int(torch.randint(0, 10**9, (1,), generator=gen))
        count = int(torch.randint(1, 2000, (1,), generator=gen))
        twin = noise._noise_torch(key, index, count, "cpu")
        assert twin.dtype == torch.int32 and twin.shape == (count,)
        assert int(twin.min()) >= 0 and int(twin.max()) < 2**16
        if lib is not None:
            assert torch.equal(clib.noise(lib, key, index, count), twin)
    on_meta = noise._noise_torch(2**63 + 5, 7, 1000, "meta")
    assert on_meta.device.type == "meta" and on_meta.shape == (1000,)


def test_stochastic_rounding_off_the_cpu_never_asks_for_the_library(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CUDA tensor's noise is drawn on its device by the twin: the C library is not looked
    up and nothing is copied from the host (checked on a simulated CUDA device)."""
    from _fake_cuda import fake_cuda

    def no_library() -> None:
        raise AssertionError("clib.library() asked for a CUDA tensor")

    monkeypatch.setattr(clib, "library", no_library)
    copies: list[str] = []
    with fake_cuda():
        to = torch.Tensor.to

        def spy(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
            out = to(self, *args, **kwargs)  # type: ignore[arg-type]
            if self.device.type == "cpu" and out.device.type == "cuda":
                copies.append(f"{tuple(self.shape)} {self.dtype}")
            return out

        with mock.patch.object(torch.Tensor, "to", spy):
            work = torch.zeros(3000, device="cuda")
            noise.round_stochastic_(work, noise.pass_key(3, 1, 0), index=5)
            drawn = noise.noise(11, 0, 100, device="cuda")
    assert work.device.type == "cuda" and drawn.device.type == "cuda"
    assert not copies, f"host-to-device copies of noise: {copies}"


def _fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    from mixprec_torch.compensated import compensation

    calls: list[int] = []
    run = compensation.run

    def counted(*args: object, **kwargs: object) -> None:
        calls.append(1)
        run(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(compensation, "run", counted)
    return calls


def test_the_fused_update_takes_only_group_keys_it_honours(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An LR scheduler's keys keep the fused update; a key it does not know (an option a
    later torch could add) sends the group to the generic path, which runs the optimizer's
    own step, instead of being ignored."""
    calls = _fused_calls(monkeypatch)
    net = tanh_net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    model, opt = mixprec.torch.wrap(net, opt, policy="O3-bf16-kahan")
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=10)
    assert {"max_lr", "initial_lr", "base_momentum"} <= set(opt.param_groups[0])
    train_tanh(model, opt, 2)
    sched.step()
    assert len(calls) == 2, "OneCycleLR's group keys must keep the fused update"
    opt.param_groups[0]["made_up_option"] = True
    before = [p.detach().clone() for p in model.parameters()]
    train_tanh(model, opt, 2)
    assert len(calls) == 2, "a made-up group key must take the generic path"
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    del opt.param_groups[0]["made_up_option"]
    train_tanh(model, opt, 1)
    assert len(calls) == 3


def test_the_library_is_looked_up_once_and_reports_where_it_comes_from() -> None:
    found = clib.info()
    assert clib.status() == found.describe()
    assert clib.backend_notes() == [f"CPU kernels: {found.describe()}"]
    if found.in_use:
        assert clib.library() is clib.library() is not None
        assert found.origin in ("installed", "built") and Path(found.path).is_file()
    else:
        assert found.reason
