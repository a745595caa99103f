"""Every backend resolves its policy through mixprec.engine.spec.resolve_for_device: the hook
fires once per wrap with the backend's name and device, and a refused policy fires nothing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mixprec.engine import plugins
from mixprec.errors import UnsupportedDtypeError
from mixprec.kit import Policy, hookimpl


class Observer:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str]] = []

    @hookimpl
    def mixprec_policy_resolved(self, policy: Policy, backend: str, device: str) -> None:
        self.seen.append((str(policy), backend, device))


@pytest.fixture
def observer() -> Iterator[Observer]:
    plugins.reset()
    seen = Observer()
    plugins.register(seen, name="observer")
    yield seen
    plugins.reset()


def test_numpy(observer: Observer) -> None:
    mixprec_numpy = pytest.importorskip("mixprec_numpy")
    model = mixprec_numpy.MLP([4, 3, 2], seed=0)
    mixprec_numpy.Trainer(model, mixprec_numpy.SGD(lr=0.1), policy="O2-bf16")
    assert observer.seen == [("O2-bf16", "numpy", "cpu")]


def test_torch(observer: Observer) -> None:
    torch = pytest.importorskip("torch")
    import mixprec.torch as mp

    model = torch.nn.Linear(3, 2)
    mp.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="O1-bf16")
    assert observer.seen == [("O1-bf16", "torch", "cpu")]


def test_mxnet(observer: Observer) -> None:
    mx = pytest.importorskip("mxnet")
    import mixprec.mxnet as mpx

    net = mx.gluon.nn.Dense(2, in_units=3)
    net.initialize()
    mpx.Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O0")
    assert observer.seen == [("O0", "mxnet", "cpu")]
    with pytest.raises(UnsupportedDtypeError):  # float16 on CPU: refused before the hook
        mpx.Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O1")
    assert len(observer.seen) == 1
