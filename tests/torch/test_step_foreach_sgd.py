"""The step runs torch's foreach SGD where the user left the implementation to torch, and
only where its bits are the for-loop's (``mixprec_torch.step.master_update``).

Every test feeds the same gradients to a wrapped SGD and to a plain, unwrapped
``torch.optim.SGD`` (its for-loop implementation, torch's choice on the CPU), and compares
weights, momentum buffers, the gradients left after the step and the state dict bit for bit;
a spy on torch's two implementations says which one ran.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.optim.sgd as torch_sgd  # noqa: E402
from _torch_nets import same  # noqa: E402
from torch import nn  # noqa: E402

import mixprec  # noqa: E402
import mixprec.torch as mpt  # noqa: E402
from mixprec_torch.step import master_update  # noqa: E402

pytestmark = pytest.mark.torch

# odd sizes: elements past the last full vector of every width are updated too
SHAPES = [(1,), (7,), (16,), (33,), (5, 7), (100,), (3, 67)]
STEPS = 5


class Params(nn.Module):
    """Parameters whose gradients are whatever the test says: ``loss(grads)``."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.ps = nn.ParameterList(
            nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES
        )

    def loss(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        terms = [
            (p * g.to(p.dtype)).sum() for p, g in zip(self.ps, grads, strict=True) if g is not None
        ]
        return torch.stack([t.float() for t in terms]).sum()


def gradients(step: int, *, sparse_start: bool = False) -> list[torch.Tensor | None]:
    """Step ``step``'s gradient of each parameter; with ``sparse_start`` every third
    parameter has none in the first two steps (its momentum buffer starts later)."""
    gen = torch.Generator().manual_seed(100 + step)
    grads: list[torch.Tensor | None] = [torch.randn(s, generator=gen) * 3 for s in SHAPES]
    if sparse_start and step < 2:
        grads = [None if i % 3 == 0 else g for i, g in enumerate(grads)]
    return grads


class Spy:
    """Counts the calls of torch's for-loop and foreach SGD."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = {"for-loop": 0, "foreach": 0}
        for name, key in (("_single_tensor_sgd", "for-loop"), ("_multi_tensor_sgd", "foreach")):
            original = getattr(torch_sgd, name)

            def counted(*args: Any, _f: Any = original, _k: str = key, **kwargs: Any) -> Any:
                self.calls[_k] += 1
                return _f(*args, **kwargs)

            monkeypatch.setattr(torch_sgd, name, counted)


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Iterator[Spy]:
    yield Spy(monkeypatch)


def run_pair(
    policy: str,
    options: dict[str, Any],
    *,
    sparse_start: bool = False,
    skip_at: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[list[Any], list[Any]]:
    """Train a wrapped and a plain SGD on the same gradients; per step, (weights, momentum
    buffers, gradients after the step, the state dict's groups) of each."""
    ref_model = Params(dtype)
    ref_opt = torch.optim.SGD(ref_model.parameters(), **options)
    model = Params(dtype)
    model, opt = mpt.wrap(model, torch.optim.SGD(model.parameters(), **options), policy=policy)
    seen: tuple[list[Any], list[Any]] = ([], [])
    for step in range(STEPS):
        grads = gradients(step, sparse_start=sparse_start)
        ref_opt.zero_grad()
        opt.zero_grad()
        if step != skip_at:  # the reference takes no step where the wrapped one skips
            ref_model.loss(grads).backward()
            ref_opt.step()
        if step == skip_at:
            grads = [g.clone() if g is not None else None for g in grads]
            grads[1].view(-1)[0] = float("inf")  # type: ignore[union-attr]
        with mpt.scale_loss(model.loss(grads), opt) as scaled:
            scaled.backward()
        opt.step()
        for out, m, o in ((seen[0], ref_model, ref_opt), (seen[1], model, opt)):
            params = [p for p in m.parameters()]
            out.append(
                (
                    [p.detach().clone() for p in params],
                    [o.state[p].get("momentum_buffer") for p in o.param_groups[0]["params"]],
                    [None if p.grad is None or step == skip_at else p.grad.clone() for p in params],
                    o.state_dict()["param_groups"],
                )
            )
    return seen


CONFIGS = {
    "plain": {"lr": 0.05},
    "momentum": {"lr": 0.05, "momentum": 0.9},
    "dampening": {"lr": 0.05, "momentum": 0.9, "dampening": 0.25},
    "weight decay": {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-2},
    "nesterov, weight decay": {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-2},
    "nesterov, maximize": {"lr": 0.05, "momentum": 0.9, "nesterov": True, "maximize": True},
    "maximize": {"lr": 0.05, "momentum": 0.5, "maximize": True},
    "everything": {
        "lr": 0.013,
        "momentum": 0.8,
        "dampening": 0.1,
        "weight_decay": 3e-3,
        "maximize": True,
    },
}


@pytest.mark.parametrize("policy", ["O0", "O1"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_foreach_sgd_gives_the_for_loops_bits(spy: Spy, policy: str, config: str) -> None:
    ref, got = run_pair(policy, CONFIGS[config])
    assert spy.calls["foreach"] == STEPS  # the wrapped optimizer's steps, all of them
    assert spy.calls["for-loop"] == STEPS  # the reference's
    assert same(got, ref)


@pytest.mark.parametrize("policy", ["O0", "O1"])
def test_momentum_buffers_that_start_late_and_skipped_steps_keep_the_bits(
    spy: Spy, policy: str
) -> None:
    """Some parameters get their first gradient (and momentum buffer) two steps late; one
    step overflows and is skipped by the wrapped optimizer, not taken by the reference."""
    ref, got = run_pair(
        policy, CONFIGS["dampening"] | {"weight_decay": 1e-3}, sparse_start=True, skip_at=3
    )
    assert spy.calls["foreach"] == STEPS - 1
    assert same(got, ref)
    assert not same(got[2][0], got[4][0])  # it trained


@pytest.mark.parametrize(
    ("why", "options"),
    [
        ("the user chose the for-loop", {"foreach": False}),
        ("the user chose fused", {"fused": False}),
        ("nesterov would add into the gradients", {"momentum": 0.9, "nesterov": True}),
        ("a tensor learning rate", {"lr": torch.tensor(0.05)}),
        ("a tensor learning rate, momentum", {"lr": torch.tensor(0.05), "momentum": 0.9}),
    ],
)
def test_the_for_loop_stays_where_foreach_is_not_the_same(
    spy: Spy, why: str, options: dict[str, Any]
) -> None:
    ref, got = run_pair("O1", {"lr": 0.05} | options)
    assert spy.calls["foreach"] == 0, why
    assert same(got, ref)


def test_a_users_foreach_true_is_theirs(spy: Spy) -> None:
    """foreach=True stays in the groups: mixprec sets back only what it set."""
    model = Params()
    model, opt = mpt.wrap(
        model, torch.optim.SGD(model.parameters(), lr=0.1, foreach=True), policy="O1"
    )
    for step in range(2):
        opt.zero_grad()
        with mpt.scale_loss(model.loss(gradients(step)), opt) as scaled:
            scaled.backward()
        opt.step()
    assert spy.calls == {"for-loop": 0, "foreach": 2}
    assert opt.param_groups[0]["foreach"] is True


def test_bfloat16_parameters_keep_the_for_loop(spy: Spy) -> None:
    """In bfloat16 torch's foreach ops round the momentum to bfloat16 first: not the same."""
    model = Params()
    model, opt = mpt.wrap(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), policy="O3-bf16"
    )
    assert all(p.dtype == torch.bfloat16 for p in opt.param_groups[0]["params"])
    for step in range(2):
        opt.zero_grad()
        with mpt.scale_loss(model.loss(gradients(step)), opt) as scaled:
            scaled.backward()
        opt.step()
    assert spy.calls == {"for-loop": 2, "foreach": 0}


def test_a_subclass_of_sgd_keeps_its_own_step(spy: Spy) -> None:
    class MySGD(torch.optim.SGD):
        pass

    model = Params()
    model, opt = mpt.wrap(model, MySGD(model.parameters(), lr=0.1, momentum=0.9), policy="O1")
    with mpt.scale_loss(model.loss(gradients(0)), opt) as scaled:
        scaled.backward()
    opt.step()
    assert spy.calls == {"for-loop": 1, "foreach": 0}


def test_weight_decay_over_many_elements_keeps_the_for_loop(
    spy: Spy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Weight decay makes the foreach path copy every gradient at once: only while small."""
    total = sum(torch.Size(s).numel() for s in SHAPES)
    monkeypatch.setattr(master_update, "COPY_LIMIT", total - 1)
    ref, got = run_pair("O1", CONFIGS["weight decay"])
    assert spy.calls["foreach"] == 0
    assert same(got, ref)
    spy.calls["for-loop"] = 0
    ref, got = run_pair("O1", CONFIGS["momentum"])  # no copy: foreach whatever the size
    assert spy.calls["foreach"] == STEPS
    assert same(got, ref)


def test_sparse_gradients_keep_the_for_loop(spy: Spy) -> None:
    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(20, 6, sparse=True), nn.Linear(6, 3))
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    ref_model, ref_opt = build()
    model, opt = mpt.wrap(*build(), policy="O0")
    for step in range(3):
        idx = torch.randint(0, 20, (8,), generator=torch.Generator().manual_seed(step))
        ref_opt.zero_grad()
        ref_model(idx).square().sum().backward()
        ref_opt.step()
        opt.zero_grad()
        with mpt.scale_loss(model(idx).square().sum(), opt) as scaled:
            scaled.backward()
        assert model[0].weight.grad is not None and model[0].weight.grad.is_sparse
        opt.step()
    assert spy.calls == {"for-loop": 6, "foreach": 0}
    assert same(list(model.parameters()), list(ref_model.parameters()))


def test_the_groups_foreach_is_none_again_even_when_the_step_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("boom")

    model = Params()
    model, opt = mpt.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="O1")
    monkeypatch.setattr(torch_sgd, "_multi_tensor_sgd", broken)
    with mpt.scale_loss(model.loss(gradients(0)), opt) as scaled:
        scaled.backward()
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    assert opt.param_groups[0]["foreach"] is None


@pytest.mark.parametrize("policy", ["O2", "O2-bf16"])
def test_float32_masters_step_the_same_with_and_without_foreach(
    spy: Spy, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    """Under O2 the SGD updates mixprec's float32 masters: the model's half-precision weights
    and the masters come out the same with the foreach SGD as with the for-loop."""
    from mixprec_torch.step import protocol

    # a scale the float16 gradients hold: every step is taken
    overrides = {"loss_scale": mixprec.DynamicScale(init=16.0)} if policy == "O2" else {}

    def train() -> list[Any]:
        model = Params()
        model, opt = mpt.wrap(
            model,
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3),
            policy=policy,
            **overrides,
        )
        for step in range(STEPS):
            opt.zero_grad()
            with mpt.scale_loss(model.loss(gradients(step)), opt) as scaled:
                scaled.backward()
            opt.step()
        masters = mpt.master_params(opt)
        return [
            [p.detach().clone() for p in model.parameters()],
            [m.detach().clone() for m in masters],
            [opt.state[m]["momentum_buffer"] for m in masters],
        ]

    routed = train()
    assert spy.calls == {"for-loop": 0, "foreach": STEPS}
    monkeypatch.setattr(protocol, "foreach_sgd_elements", lambda optimizer: 0)
    looped = train()
    assert spy.calls == {"for-loop": STEPS, "foreach": STEPS}
    assert routed[0][0].dtype != torch.float32  # the model's own weights are half precision
    assert same(routed, looped)
