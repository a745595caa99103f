"""Resume into a fresh net is bit-exact in every order users load in: the Trainer built before
or after ``load_parameters``, shapes deferred or known, hybridized or not (issue 26).

On a model_zoo net (mobilenet0_25, ``pretrained=False``). Where the CPU has bfloat16 kernels,
whether BatchNorm reads a convolution's bfloat16 output directly depends on the convolution's
channels; a deferred net once traced its graph before its shapes were known and a net with
loaded shapes after, so the two computed BatchNorm slightly differently (6 of 216 elements of
``conv0_weight`` one bfloat16 step off). ``cpu_isa``: run on AVX512 and as on AVX2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

from mxnet import autograd, gluon  # noqa: E402
from mxnet.gluon.model_zoo import vision  # noqa: E402

from mixprec_mxnet import Trainer  # noqa: E402
from mixprec_mxnet.dtypes import cast  # noqa: E402

pytestmark = [pytest.mark.mxnet, pytest.mark.cpu_isa]

CE = gluon.loss.SoftmaxCrossEntropyLoss()
RNG = np.random.RandomState(0)
X, Y = mx.nd.array(RNG.rand(2, 3, 32, 32)), mx.nd.array([1, 2])


def _net(deferred: bool, hybrid: bool) -> Any:
    mx.random.seed(0)
    net = vision.mobilenet0_25(pretrained=False, classes=4)
    net.initialize(mx.init.Xavier())
    if not deferred:
        net(X)  # shapes known before the Trainer
    if hybrid:
        net.hybridize()
    return net


def _trainer(net: Any, policy: str) -> Trainer:
    return Trainer(net, "adam", {"learning_rate": 1e-2}, policy=policy)


def _train(net: Any, trainer: Any, steps: int = 2) -> None:
    for _ in range(steps):
        with autograd.record():
            loss = CE(cast(net(X), "float32"), Y)
            with trainer.scale_loss(loss) as scaled:
                autograd.backward(scaled)
        trainer.step(X.shape[0])


def _values(net: Any) -> dict[str, np.ndarray]:
    return {
        name: cast(p.data(), "float32").asnumpy()
        for name, p in net._collect_params_with_prefix().items()
    }


def _resume(tmp_path: Path, policy: str, trainer_first: bool, deferred: bool, hybrid: bool) -> None:
    net = _net(deferred, hybrid)
    trainer = _trainer(net, policy)
    _train(net, trainer)
    net.save_parameters(str(tmp_path / "p.params"))
    trainer.save_states(str(tmp_path / "t.states"))
    _train(net, trainer)

    fresh = _net(deferred, hybrid)
    if trainer_first:
        resumed = _trainer(fresh, policy)
        fresh.load_parameters(str(tmp_path / "p.params"))
    else:
        fresh.load_parameters(str(tmp_path / "p.params"))
        resumed = _trainer(fresh, policy)
    resumed.load_states(str(tmp_path / "t.states"))
    _train(fresh, resumed)
    expected, got = _values(net), _values(fresh)
    assert expected.keys() == got.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybridized", "imperative"])
@pytest.mark.parametrize("deferred", [True, False], ids=["deferred", "shaped"])
@pytest.mark.parametrize("trainer_first", [True, False], ids=["trainer-first", "params-first"])
def test_o2_bf16_resume_is_exact_in_every_order(
    tmp_path: Path, trainer_first: bool, deferred: bool, hybrid: bool
) -> None:
    _resume(tmp_path, "O2-bf16", trainer_first, deferred, hybrid)


@pytest.mark.parametrize("policy", ["O1-bf16", "O3-bf16", "O3-bf16-kahan"])
def test_other_bf16_presets_resume_exactly_into_a_deferred_net(tmp_path: Path, policy: str) -> None:
    _resume(tmp_path, policy, trainer_first=True, deferred=True, hybrid=True)
