"""The step's state in three values (mixprec_torch.step.optimizer_state): the layout of the
parameter groups (built once per change of the groups), the iteration (a fresh value when a
``step()`` ends, taken or skipped, never flags reset one by one) and the history."""

from __future__ import annotations

import math
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import mixprec  # noqa: E402
import mixprec.torch as mpt  # noqa: E402
from mixprec_torch.step.optimizer_state import Iteration, Layout, OptimizerState  # noqa: E402

pytestmark = pytest.mark.torch


def _wrapped(policy: str, optimizer: type = torch.optim.SGD, **kwargs: Any) -> tuple[Any, Any]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = optimizer(net.parameters(), lr=1e-2, **kwargs)
    return mixprec.torch.wrap(net, opt, policy=policy)


def _backward(model: Any, opt: Any, poison: bool = False) -> None:
    opt.zero_grad()
    loss = model(torch.randn(3, 4)).float().pow(2).mean()
    with mpt.scale_loss(loss, opt) as scaled:
        scaled.backward()
    if poison:
        next(model.parameters()).grad[0, 0] = math.inf


def _state(opt: Any) -> OptimizerState:
    st = opt._mixprec
    assert isinstance(st, OptimizerState)
    return st


def _fresh(it: Iteration) -> bool:
    return (
        it.round is None
        and it.found_inf == []
        and it.found_on_host is None
        and not it.unchecked
        and not it.implicit_unscale
        and it.checked is None
        and it.grad_marks is None
        and not it.grads_cast
        and not it.reevaluating
    )


@pytest.mark.parametrize("poison", [False, True], ids=["taken", "skipped"])
@pytest.mark.parametrize("policy", ["O1", "O2", "O2-bf16"])
def test_each_step_ends_with_a_fresh_iteration(policy: str, poison: bool) -> None:
    model, opt = _wrapped(policy)
    st = _state(opt)
    assert _fresh(st.iteration)
    _backward(model, opt, poison)
    mpt.unscale_(opt)  # fills the iteration: grad marks, unchecked flags
    filled = st.iteration
    assert filled.unchecked
    opt.step()
    assert mpt.state(opt).last_step_skipped is poison
    assert st.iteration is not filled and _fresh(st.iteration)
    assert st.tracker.steps == 1  # the history carries on


def test_a_skipped_round_of_two_optimizers_leaves_both_fresh() -> None:
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 2)
    models, opts = mixprec.torch.wrap(
        [a, b],
        [torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)],
        policy="O2",
    )
    loss = models[1](models[0](torch.randn(3, 4))).float().sum()
    with mpt.scale_loss(loss, opts) as scaled:
        scaled.backward()
    next(models[1].parameters()).grad[0, 0] = math.nan
    opts[0].step()  # opens the round for both: the second one's iteration holds the decision
    second = _state(opts[1]).iteration
    assert second.round is not None and second.round.skipped and second.implicit_unscale
    assert _fresh(_state(opts[0]).iteration)
    opts[1].step()
    assert _fresh(_state(opts[1]).iteration)


def test_the_layout_is_built_once_and_dropped_when_the_groups_change() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(net[0].parameters(), lr=1e-2)  # the head joins later
    model, opt = mixprec.torch.wrap(net, opt, policy="O2")
    _backward(model, opt)
    opt.step()
    lay = _state(opt).layout
    assert isinstance(lay, Layout)
    assert len(lay.params) == len(lay.masters) == 2
    assert lay.versions is not None  # the counters after the master copy
    for _ in range(2):
        _backward(model, opt)
        opt.step()
    assert _state(opt).layout is lay
    opt.add_param_group({"params": list(model[2].parameters())})
    assert _state(opt).layout is None
    _backward(model, opt)
    opt.step()
    rebuilt = _state(opt).layout
    assert rebuilt is not None and rebuilt is not lay and len(rebuilt.params) == 4


def test_the_fusable_walk_runs_once_per_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _wrapped("O3-bf16-kahan")
    comp = _state(opt).group.compensation
    assert comp is not None
    cls = type(comp)
    calls: dict[str, int] = {"walk": 0, "options": 0, "fill": 0}
    walk, options, fill = cls.fusable_params, cls.fusable_options, cls.fill

    def counted(name: str, real: Any) -> Any:
        def call(self: Any, optimizer: Any) -> Any:
            calls[name] += 1
            return real(self, optimizer)

        return call

    monkeypatch.setattr(cls, "fusable_params", counted("walk", walk))
    monkeypatch.setattr(cls, "fusable_options", counted("options", options))
    monkeypatch.setattr(cls, "fill", counted("fill", fill))
    for _ in range(3):
        _backward(model, opt)
        opt.step()
    lay = _state(opt).layout
    assert lay is not None and lay.fusable is True
    assert calls["walk"] == 1 and calls["fill"] == 0  # the fused update, walked once
    assert calls["options"] >= 3  # the groups' options are read every step: they may change
    opt.param_groups[0]["an_option_of_another_library"] = 1
    _backward(model, opt)
    opt.step()
    assert calls["walk"] == 1 and calls["fill"] == 1  # the generic path, no second walk


def test_loading_a_state_dict_mid_iteration_starts_a_fresh_one() -> None:
    model, opt = _wrapped("O2")
    _backward(model, opt)
    opt.step()
    saved = opt.state_dict()
    _backward(model, opt)
    mpt.unscale_(opt)  # grad marks and an unchecked unscale in the iteration
    opt.load_state_dict(saved)
    assert _fresh(_state(opt).iteration)
    _backward(model, opt)
    opt.step()
    assert not mpt.state(opt).last_step_skipped
    assert all(
        torch.equal(p, m.to(p.dtype))
        for p, m in zip(model.parameters(), mpt.master_params(opt), strict=True)
    )
