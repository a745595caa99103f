"""Small Gluon nets and loops shared by the MXNet backend tests."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon, nd

from mixprec_mxnet.bf16_kernels import missing_bf16_cpu_ops
from mixprec_mxnet.dtypes import cast
from mixprec_mxnet.step.state_files import FORMAT, META, seal


def bf16_computes(op: str) -> str:
    """The dtype native ``op`` computes in where a rule says bfloat16, on this machine: float32
    where the probe found no bfloat16 CPU kernel (a float32 island), else bfloat16."""
    return "float32" if op in missing_bf16_cpu_ops() else "bfloat16"


def mlp(ctx: Any = None, seed: int = 0) -> gluon.HybridSequential:
    """Dense(16, relu) -> Dense(4), shapes known up front."""
    mx.random.seed(seed)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(16, in_units=8, activation="relu"), gluon.nn.Dense(4, in_units=16))
    net.initialize(mx.init.Xavier(), ctx=ctx)
    return net


def cnn(ctx: Any = None, seed: int = 0, frozen_bn: bool = False) -> gluon.HybridSequential:
    """Conv-BN-ReLU x2, max pool, two Dense layers; for 1x8x8 images and 10 classes."""
    mx.random.seed(seed)
    bn = {"use_global_stats": True} if frozen_bn else {}
    net = gluon.nn.HybridSequential()
    net.add(
        gluon.nn.Conv2D(16, 3, padding=1, in_channels=1),
        gluon.nn.BatchNorm(in_channels=16, **bn),
        gluon.nn.Activation("relu"),
        gluon.nn.Conv2D(32, 3, padding=1, in_channels=16),
        gluon.nn.BatchNorm(in_channels=32, **bn),
        gluon.nn.Activation("relu"),
        gluon.nn.MaxPool2D(),
        gluon.nn.Flatten(),
        gluon.nn.Dense(64, in_units=32 * 16, activation="relu"),
        gluon.nn.Dense(10, in_units=64),
    )
    net.initialize(mx.init.Xavier(), ctx=ctx)
    return net


def array(values: Any) -> nd.NDArray:
    """A float32 NDArray from numpy (``nd.array`` warns when SciPy is installed)."""
    values = np.asarray(values, dtype="float32")
    out = nd.empty(values.shape)
    out[:] = values
    return out


def batch(n: int = 8, seed: int = 0, image: bool = False) -> tuple[nd.NDArray, nd.NDArray]:
    """A fixed random batch: (n, 8) inputs and (n, 4) targets, or images and class labels."""
    rng = np.random.RandomState(seed)
    if image:
        return array(rng.rand(n, 1, 8, 8)), array(rng.randint(0, 10, n))
    return array(rng.randn(n, 8)), array(rng.randn(n, 4))


def train_step(net: Any, trainer: Any, x: Any, y: Any, loss_fn: Any, inject: bool = False) -> float:
    """One loop iteration as a user writes it; optionally an inf in the first gradient."""
    with autograd.record():
        loss = loss_fn(net(x), y)
        with trainer.scale_loss(loss) as scaled:
            autograd.backward(scaled)
    if inject:
        next(iter(net.collect_params().values())).grad()[0, 0] = float("inf")
    trainer.step(x.shape[0])
    return float(cast(loss.mean(), "float32").asscalar())


def train_replicas(net: Any, trainer: Any, contexts: list[Any], steps: int = 3) -> None:
    """``steps`` data-parallel steps on one fixed batch split over ``contexts`` (an L2 loss
    per replica, backward without loss scaling: the bfloat16 policies have none)."""
    l2 = gluon.loss.L2Loss()
    x, y = batch(n=8)
    xs, ys = gluon.utils.split_and_load(x, contexts), gluon.utils.split_and_load(y, contexts)
    for _ in range(steps):
        with autograd.record():
            losses = [l2(net(a).astype("float32"), b) for a, b in zip(xs, ys, strict=True)]
        autograd.backward(losses)
        trainer.step(8)


def values(net: Any, ctx: Any = None) -> dict[str, np.ndarray]:
    """Every parameter as float32 numpy, by structural name ("0.weight")."""
    return {
        name: cast(p.data(ctx), "float32").asnumpy()
        for name, p in net._collect_params_with_prefix().items()
    }


def master_values(trainer: Any, net: Any) -> dict[str, np.ndarray]:
    """The trainer's master of every parameter, by structural name."""
    return {
        name: trainer.masters.master_for(p).data().asnumpy()
        for name, p in net._collect_params_with_prefix().items()
    }


def states_header(path: Any) -> dict[str, Any]:
    """The JSON header of a states file ``trainer.save_states`` wrote."""
    return json.loads(nd.load(str(path))[META].asnumpy().tobytes().decode("utf-8"))  # type: ignore[no-any-return]


def rewrite_states(path: Any, edit: Callable[[dict[str, Any], dict[str, Any]], None]) -> None:
    """Rewrite a states file after ``edit(header, arrays)`` changed it in place (as an
    attacker or a damaged disk might)."""
    arrays = dict(nd.load(str(path)))
    header = json.loads(arrays[META].asnumpy().tobytes().decode("utf-8"))
    edit(header, arrays)
    raw = np.frombuffer(json.dumps(header).encode("utf-8"), dtype=np.uint8)
    arrays[META] = nd.empty(raw.shape, dtype=np.uint8)
    arrays[META][:] = raw
    nd.save(str(path), arrays)
    if header.get("format") == FORMAT:  # re-sealed, as a writer of its own would
        body = Path(path).read_bytes()
        Path(path).write_bytes(body + seal(body))
