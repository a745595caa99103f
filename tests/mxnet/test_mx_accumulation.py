"""Gradient accumulation (grad_req='add') and zero_grad under mixprec's Gluon policies."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

from _mx_nets import array, mlp, values  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402
from mxnet.gluon.model_zoo import vision  # noqa: E402

import mixprec  # noqa: E402
from mixprec.errors import StepOrderError, WrapError  # noqa: E402
from mixprec_mxnet import Trainer  # noqa: E402
from mixprec_mxnet.dtypes import cast  # noqa: E402
from mixprec_mxnet.step.accumulation import Accumulation  # noqa: E402

pytestmark = pytest.mark.mxnet

#: O1-bf16 with elementwise products in bfloat16: they have a bfloat16 kernel on every CPU,
#: so the graph pass casts the scale parameter below with amp_cast even without AVX512-BF16.
O1_MUL = mixprec.get_policy("O1-bf16").with_ops(lowp=["mul"])


class Scaled(gluon.HybridBlock):
    """Dense, then a learned per-feature scale (the layer-scale of modern nets)."""

    def __init__(self) -> None:
        super().__init__()
        with self.name_scope():
            self.dense = gluon.nn.Dense(4, in_units=8)
            self.scale = self.params.get("scale", shape=(1, 4), init=mx.init.Constant(0.5))

    def hybrid_forward(self, F: Any, x: Any, scale: Any) -> Any:
        return F.broadcast_mul(self.dense(x), scale)


def _scaled(seed: int = 0) -> Scaled:
    mx.random.seed(seed)
    net = Scaled()
    net.initialize(mx.init.Xavier())
    return net


def _micro_batches(n: int = 2, shape: tuple[int, ...] = (4, 8)) -> list[Any]:
    rng = np.random.RandomState(3)
    return [array(rng.randn(*shape)) for _ in range(n)]


def _grads(net: Any) -> dict[str, np.ndarray]:
    """Gradients by structural name ("dense.weight"), equal across two builds of a net."""
    return {
        name: cast(p.grad(), "float32").asnumpy()
        for name, p in net._collect_params_with_prefix().items()
        if p.grad_req != "null"
    }


def _backward(net: Any, x: Any) -> None:
    with autograd.record():
        out = net(x)
        loss = (cast(out, "float32") ** 2).sum()
    loss.backward()


def _accumulated_and_summed(make: Any, policy: Any, batches: list[Any]) -> tuple[Any, Any]:
    """Gradients of grad_req='add' over ``batches``, and the sum of per-batch gradients."""
    net = make()
    net.collect_params().setattr("grad_req", "add")
    Trainer(net, "sgd", {"learning_rate": 0.1}, policy=policy)
    for x in batches:
        _backward(net, x)
    accumulated = _grads(net)
    net = make()
    Trainer(net, "sgd", {"learning_rate": 0.1}, policy=policy)
    summed: dict[str, np.ndarray] = {}
    for x in batches:
        _backward(net, x)
        for name, grad in _grads(net).items():
            summed[name] = summed.get(name, 0) + grad
    return accumulated, summed


def test_o1_accumulates_parameters_the_graph_pass_casts() -> None:
    """MXNet's amp_cast drops grad_req='add' (the cast parameter got exactly 0)."""
    accumulated, summed = _accumulated_and_summed(_scaled, O1_MUL, _micro_batches())
    scale = next(name for name in summed if name.endswith("scale"))
    assert np.abs(summed[scale]).sum() > 0
    for name, grad in summed.items():
        np.testing.assert_allclose(accumulated[name], grad, rtol=2e-2, atol=1e-3, err_msg=name)


@pytest.mark.slow
def test_o1_accumulation_on_resnet18() -> None:
    def make() -> Any:
        mx.random.seed(0)
        net = vision.resnet18_v1(pretrained=False, classes=4)
        net.initialize(mx.init.Xavier())
        return net

    batches = _micro_batches(2, (2, 3, 16, 16))
    accumulated, summed = _accumulated_and_summed(make, "O1-bf16", batches)
    zero = [name for name, grad in accumulated.items() if not np.abs(grad).sum()]
    assert not zero
    for name, grad in summed.items():
        np.testing.assert_allclose(accumulated[name], grad, rtol=5e-2, atol=1e-3, err_msg=name)


# ---------------------------------------------------------------- O2/O3: float32 sums

CE = gluon.loss.SoftmaxCrossEntropyLoss()


def _mobilenet(seed: int = 0) -> Any:
    mx.random.seed(seed)
    net = vision.mobilenet0_25(pretrained=False, classes=4)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    return net


def _images(n: int, seed: int = 0) -> tuple[Any, Any]:
    rng = np.random.RandomState(seed)
    return array(rng.rand(n, 3, 32, 32)), array(rng.randint(0, 4, n))


def _scaled_backward(net: Any, trainer: Any, x: Any, y: Any, train: bool = True) -> None:
    with autograd.record(train_mode=train):
        loss = CE(cast(net(x), "float32"), y)
        with trainer.scale_loss(loss) as scaled:
            autograd.backward(scaled)


def _master_grads(net: Any, trainer: Any) -> dict[str, np.ndarray]:
    return {
        name: trainer.masters.master_for(p).grad().asnumpy().copy()
        for name, p in net._collect_params_with_prefix().items()
        if p.grad_req != "null"
    }


@pytest.mark.cpu_isa
@pytest.mark.parametrize("policy", ["O2-bf16", "O3-bf16-kahan"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_low_precision_accumulation_sums_the_micro_batches_in_float32(
    policy: str, when: str
) -> None:
    """grad_req='add' (set before or after the Trainer) on mobilenet0_25: the masters hold
    exactly the float32 sum of the micro-batches' bfloat16 gradients, the step applies it,
    zero_grad clears it and the next accumulated step moves the weights again."""
    batches = [_images(2, seed) for seed in (1, 2)]
    reference = _mobilenet()
    ref_trainer = Trainer(reference, "sgd", {"learning_rate": 0.1}, policy=policy)
    summed: dict[str, np.ndarray] = {}
    for x, y in batches:  # grad_req='write': one micro-batch's bfloat16 gradient at a time
        _scaled_backward(reference, ref_trainer, x, y)
        for name, grad in _grads(reference).items():
            summed[name] = summed.get(name, 0) + grad

    net = _mobilenet()
    if when == "before":
        net.collect_params().setattr("grad_req", "add")
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy=policy)
    if when == "after":
        net.collect_params().setattr("grad_req", "add")
    for x, y in batches:
        _scaled_backward(net, trainer, x, y)
    accumulated = _master_grads(net, trainer)
    assert accumulated.keys() == summed.keys()
    for name, grad in summed.items():
        np.testing.assert_array_equal(accumulated[name], grad, err_msg=name)
    before = values(net)
    trainer.step(4)
    assert not trainer.last_step_skipped
    moved = values(net)
    assert any(not np.array_equal(before[k], moved[k]) for k in before)
    net.collect_params().zero_grad()
    assert not any(g.any() for g in _master_grads(net, trainer).values())
    for x, y in batches:
        _scaled_backward(net, trainer, x, y)
    trainer.step(4)
    assert any(not np.array_equal(moved[k], v) for k, v in values(net).items())


@pytest.mark.cpu_isa
def test_two_micro_batches_equal_one_double_batch_within_bf16_rounding() -> None:
    """Without BatchNorm a sample's gradient does not depend on its batch, so the float32 sum
    of two halves' bfloat16 gradients and the double batch's bfloat16 gradient differ only
    by bfloat16 rounding: at most half a bfloat16 step of each half and of the whole,
    element by element. (With BatchNorm in training mode the halves' batch statistics differ
    from the whole's: MXNet's own float32 gradients then differ by 5% on mobilenet0_25.)"""
    x, y = _micro_batches(1, (8, 8))[0], _micro_batches(1, (8, 4))[0]
    L2 = gluon.loss.L2Loss()
    halves = []
    for part in (slice(0, 4), slice(4, 8), slice(0, 8)):  # each half alone, then the whole
        net = mlp()
        trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
        with autograd.record():
            loss = L2(cast(net(x[part]), "float32"), y[part])
            with trainer.scale_loss(loss) as scaled:
                autograd.backward(scaled)
        halves.append(_grads(net))
    first, second, whole = halves
    net = mlp()
    net.collect_params().setattr("grad_req", "add")
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
    for part in (slice(0, 4), slice(4, 8)):
        with autograd.record():
            loss = L2(cast(net(x[part]), "float32"), y[part])
            with trainer.scale_loss(loss) as scaled:
                autograd.backward(scaled)
    summed = {n: trainer.masters.master_for(p).grad().asnumpy()
              for n, p in net._collect_params_with_prefix().items()}  # fmt: skip
    step = 2.0**-8  # half a bfloat16 step, relative
    for name, grad in summed.items():
        np.testing.assert_array_equal(grad, first[name] + second[name])  # the float32 sum
        bound = step * (np.abs(first[name]) + np.abs(second[name]) + np.abs(whole[name]))
        assert (np.abs(grad - whole[name]) <= bound + 1e-30).all(), name


def test_accumulating_without_scale_loss_is_refused_naming_it() -> None:
    """A plain loss.backward() under O2-bf16 would sum in bfloat16 (or not at all through an
    island's cast): the step refuses it before anything changes."""
    net = _mobilenet()
    net.collect_params().setattr("grad_req", "add")
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
    x, y = _images(2)
    for _ in range(2):
        with autograd.record():
            loss = CE(cast(net(x), "float32"), y)
        loss.backward()
    before, steps = values(net), trainer.scaler.steps
    with pytest.raises(StepOrderError, match=r"scale_loss\(loss\)"):
        trainer.step(4)
    assert trainer.scaler.steps == steps
    assert all(np.array_equal(v, values(net)[k]) for k, v in before.items())


def test_the_accumulation_check_runs_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """``step`` checks ``grad_req`` and the micro-batches once, before anything moves (its
    reduce used to check again); each of ``allreduce_grads`` and ``update`` called by the
    user checks once, as before."""
    net = _scaled()
    net.collect_params().setattr("grad_req", "add")
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
    checks: list[str] = []
    check = Accumulation.check

    def counted(self: Accumulation, params: Any, label: str) -> None:
        checks.append(label)
        check(self, params, label)

    monkeypatch.setattr(Accumulation, "check", counted)

    def backward() -> None:
        with autograd.record():
            loss = (cast(net(_micro_batches(1)[0]), "float32") ** 2).sum()
            with trainer.scale_loss(loss) as scaled:
                autograd.backward(scaled)

    backward()
    trainer.step(4)
    assert len(checks) == 1
    net.collect_params().zero_grad()
    backward()
    trainer.allreduce_grads()
    trainer.update(4)
    assert len(checks) == 3


def test_add_mixed_with_write_is_refused_before_any_change() -> None:
    net = _scaled()
    net.dense.weight.grad_req = "add"
    before = {name: p.data().asnumpy().copy() for name, p in net.collect_params().items()}
    with pytest.raises(WrapError, match=r"grad_req='add' on .*but 'write' on"):
        Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
    for name, p in net.collect_params().items():
        assert np.dtype(p.dtype) == np.float32
        np.testing.assert_array_equal(p.data().asnumpy(), before[name])
    net.collect_params().setattr("grad_req", "add")
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")  # the fix works
    net.dense.bias.grad_req = "write"  # mixed after the Trainer: refused at the step
    x = _micro_batches(1)[0]
    with autograd.record():
        loss = (cast(net(x), "float32") ** 2).sum()
        with trainer.scale_loss(loss) as scaled:
            autograd.backward(scaled)
    kept = values(net)
    with pytest.raises(WrapError, match="grad_req='add'"):
        trainer.step(4)
    assert all(np.array_equal(v, values(net)[k]) for k, v in kept.items())


@pytest.mark.parametrize("policy", ["O2-bf16", "O3-bf16"])
def test_zero_grad_before_any_step_changes_nothing(policy: str) -> None:
    """zero_grad on a net that never stepped (shapes deferred, no forward yet, or no
    backward yet) has nothing to clear: it changes nothing and accumulation then works."""
    deferred = gluon.nn.HybridSequential()
    deferred.add(gluon.nn.Dense(8, activation="relu"), gluon.nn.Dense(4))
    deferred.initialize()
    deferred.collect_params().setattr("grad_req", "add")
    trainer = Trainer(deferred, "sgd", {"learning_rate": 0.1}, policy=policy)
    deferred.collect_params().zero_grad()  # no shapes, no masters yet
    x = _micro_batches(1)[0]
    for _ in range(2):
        with autograd.record():
            loss = (cast(deferred(x), "float32") ** 2).sum()
            with trainer.scale_loss(loss) as scaled:
                autograd.backward(scaled)
    sums = _master_grads(deferred, trainer)
    assert all(g.any() for g in sums.values())
    trainer.step(4)
    assert not trainer.last_step_skipped


@pytest.mark.slow
def test_zero_grad_under_o2_bf16_on_resnet18() -> None:
    """ParameterDict.zero_grad on bfloat16 gradients used to fail at the next step
    (``Unknown type enum 12``)."""
    mx.random.seed(0)
    net = vision.resnet18_v1(pretrained=False, classes=4)
    net.initialize(mx.init.Xavier())
    x = _micro_batches(1, (2, 3, 16, 16))[0]
    net(x)
    trainer = Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
    _backward(net, x)
    net.collect_params().zero_grad()
    grads = _grads(net)
    assert all(not np.abs(g).sum() for g in grads.values())
    _backward(net, x)
    before = {n: cast(p.data(), "float32").asnumpy() for n, p in net.collect_params().items()}
    trainer.step(2)
    weight = next(n for n in before if n.endswith("conv0_weight"))
    after = cast(net.collect_params()[weight].data(), "float32").asnumpy()
    assert np.abs(after - before[weight]).sum() > 0
