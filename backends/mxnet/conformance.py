"""The Gluon backend's entry into the conformance suite (:mod:`mixprec.testing`).

:class:`MXNetAdapter` runs one native op per neutral family through the same conversion the
Trainer applies (O1: the graph pass; O2/O3: no op casts) and reads the dtype the op's node
computed in; :class:`MXNetConformanceTrainer` is a two-layer net under
:class:`~mixprec_mxnet.Trainer` with momentum SGD, stepped on a fixed batch.
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
from collections.abc import Callable, Collection
from typing import Any

import mxnet as mx
from mxnet import autograd, gluon, nd

from mixprec.errors import MixprecError
from mixprec.kit import FLOAT32, LOWBIT_FORMATS, Policy, canonical_dtype, lowbit_format

from .devices import check_policy_dtypes
from .dtypes import cast, dtype_name
from .gluon_private import cached_graph, params_with_prefix
from .lowbit.codec import dequantize, quantize
from .lowbit.state import LowBitArray
from .o1.graph import install_graph_pass, node_dtypes
from .ops import FAMILY_OPS, island_families, supported_families, unsupported_natives
from .trainer import Trainer
from .wrapping.islands import install_op_islands
from .wrapping.masters import ensure_prepared

__all__ = ["OP_CASES", "MXNetAdapter", "MXNetConformanceTrainer", "conformance_adapter", "run_op"]

Case = tuple[str, list[tuple[int, ...]], Callable[..., Any], tuple[int, ...]]

# family -> (native op, input shapes, fn(F, *inputs), indices of inputs kept float32)
OP_CASES: dict[str, Case] = {
    "linear": ("FullyConnected", [(4, 6), (5, 6), (5,)],
               lambda F, x, w, b: F.FullyConnected(x, w, b, num_hidden=5), ()),
    "conv": ("Convolution", [(2, 3, 5, 5), (4, 3, 3, 3), (4,)],
             lambda F, x, w, b: F.Convolution(x, w, b, kernel=(3, 3), num_filter=4), ()),
    "conv_transpose": ("Deconvolution", [(2, 3, 5, 5), (3, 4, 3, 3), (4,)],
                       lambda F, x, w, b: F.Deconvolution(x, w, b, kernel=(3, 3), num_filter=4,
                                                          no_bias=False), ()),
    "softmax": ("softmax", [(4, 6)], lambda F, x: F.softmax(x), ()),
    "log_softmax": ("log_softmax", [(4, 6)], lambda F, x: F.log_softmax(x), ()),
    "exp": ("exp", [(4, 6)], lambda F, x: F.exp(x), ()),
    "log": ("log", [(4, 6)], lambda F, x: F.log(x), ()),
    "pow": ("broadcast_power", [(4, 6), (4, 6)], lambda F, x, y: F.broadcast_power(x, y), ()),
    "batch_norm": ("BatchNorm", [(2, 3, 4, 4), (3,), (3,), (3,), (3,)],
                   lambda F, x, g, b, m, v: F.BatchNorm(x, g, b, m, v), (1, 2, 3, 4)),
    "norm": ("norm", [(4, 6)], lambda F, x: F.norm(x), ()),
    "sum": ("sum", [(4, 6)], lambda F, x: F.sum(x), ()),
    "prod": ("prod", [(4, 6)], lambda F, x: F.prod(x), ()),
    "smooth_l1_loss": ("smooth_l1", [(4, 6)], lambda F, x: F.smooth_l1(x), ()),
    "add": ("elemwise_add", [(4, 6), (4, 6)], lambda F, x, y: F.elemwise_add(x, y), ()),
    "sub": ("elemwise_sub", [(4, 6), (4, 6)], lambda F, x, y: F.elemwise_sub(x, y), ()),
    "mul": ("elemwise_mul", [(4, 6), (4, 6)], lambda F, x, y: F.elemwise_mul(x, y), ()),
    "div": ("elemwise_div", [(4, 6), (4, 6)], lambda F, x, y: F.elemwise_div(x, y), ()),
    "cat": ("Concat", [(4, 6), (4, 6)], lambda F, x, y: F.Concat(x, y, dim=1), ()),
    "stack": ("stack", [(4, 6), (4, 6)], lambda F, x, y: F.stack(x, y), ()),
    "where": ("where", [(4, 6), (4, 6), (4, 6)], lambda F, c, x, y: F.where(c, x, y), ()),
    "relu": ("Activation", [(4, 6)], lambda F, x: F.Activation(x, act_type="relu"), ()),
    "gelu": ("LeakyReLU", [(4, 6)], lambda F, x: F.LeakyReLU(x, act_type="gelu"), ()),
    "sigmoid": ("Activation", [(4, 6)], lambda F, x: F.Activation(x, act_type="sigmoid"), ()),
    "tanh": ("Activation", [(4, 6)], lambda F, x: F.Activation(x, act_type="tanh"), ()),
    "max_pool": ("Pooling", [(2, 3, 4, 4)],
                 lambda F, x: F.Pooling(x, kernel=(2, 2), pool_type="max"), ()),
    "avg_pool": ("Pooling", [(2, 3, 4, 4)],
                 lambda F, x: F.Pooling(x, kernel=(2, 2), pool_type="avg"), ()),
    "embedding": ("Embedding", [(4,), (10, 6)],
                  lambda F, i, w: F.Embedding(i, w, input_dim=10, output_dim=6), (0,)),
}  # fmt: skip


class _OpBlock(gluon.HybridBlock):
    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__(prefix="mixprec_op_")
        self._fn = fn

    def hybrid_forward(self, F: Any, *inputs: Any) -> Any:
        return self._fn(F, *inputs)


def run_op(policy: Policy, op: str, input_dtype: str, device: str = "cpu") -> str:
    """Run ``op``'s native op as the Trainer would under ``policy``; the dtype it ran in."""
    native, shapes, fn, fp32_inputs = OP_CASES[op]
    input_dtype = canonical_dtype(input_dtype)
    check_policy_dtypes([policy.compute, input_dtype], [mx.cpu()], policy)
    mx.random.seed(0)
    inputs = [
        cast(nd.random.uniform(0.5, 1.5, shape=shape), FLOAT32 if i in fp32_inputs else input_dtype)
        for i, shape in enumerate(shapes)
    ]
    block = _OpBlock(fn)
    if policy.casts_ops:
        install_graph_pass(block, policy, device)
    else:
        # as the Trainer does under O2/O3: ops without an input_dtype kernel become islands
        install_op_islands(block, unsupported_natives(input_dtype, device), input_dtype)
        block.hybridize()
    block(*inputs).wait_to_read()
    graph_inputs, sym = cached_graph(block)
    node = next(n for n in json.loads(sym.tojson())["nodes"] if n["op"] == native)
    types = {s.name: dtype_name(a.dtype) for s, a in zip(graph_inputs, inputs, strict=True)}
    return node_dtypes(sym, **types)[node["name"]]


class MXNetAdapter:
    """The Gluon backend as the conformance suite sees it (CPU, bfloat16 or float32)."""

    name = "mxnet"
    device = "cpu"
    master_strategies = ("kahan", "stochastic")
    #: bfloat16 (under the compensated strategies) and the low-bit formats
    state_dtypes = ("bfloat16", *LOWBIT_FORMATS)

    def supported_ops(self) -> Collection[str]:
        """Families with a test case whose native ops run every rule in bfloat16 on CPU."""
        return sorted(set(OP_CASES) & supported_families("bfloat16", "cpu") & set(FAMILY_OPS))

    def fp32_islands(self, dtype: str) -> Collection[str]:
        """Families with no ``dtype`` kernel on this machine (probed), which compute in
        float32 where a rule says ``dtype``: e.g. ``linear`` on a CPU without AVX512-BF16."""
        return sorted(island_families(canonical_dtype(dtype), self.device))

    def op_dtype(self, policy: Policy, op: str, input_dtype: str) -> str:
        """The dtype ``op``'s native op computes in under ``policy`` (see :func:`run_op`)."""
        if op not in OP_CASES:
            raise MixprecError(f"the mxnet adapter has no case for op {op!r}")
        return run_op(policy, op, input_dtype, self.device)

    def lowbit_quantize(
        self, state: str, signed: bool, values: list[float]
    ) -> tuple[list[int], list[float], list[float]]:
        """``values`` encoded and decoded by the low-bit state's codec (:mod:`.lowbit.codec`)."""
        fmt = lowbit_format(state)
        codes, absmax = quantize(values, fmt, signed)
        decoded = dequantize(codes, absmax, fmt, signed, len(values))
        return codes.tolist(), absmax.tolist(), decoded.tolist()

    def make_trainer(self, policy: Policy, seed: int = 0) -> MXNetConformanceTrainer:
        """A two-layer net under :class:`~mixprec_mxnet.Trainer` with momentum SGD."""
        return MXNetConformanceTrainer(policy, seed)


def conformance_adapter() -> MXNetAdapter:
    """The adapter the conformance suite (``mixprec.testing``) runs this backend through."""
    return MXNetAdapter()


class MXNetConformanceTrainer:
    """Dense(16, relu) -> Dense(4) on a fixed batch, L2 loss, SGD with momentum."""

    def __init__(self, policy: Policy, seed: int = 0) -> None:
        mx.random.seed(seed)
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Dense(16, in_units=8, activation="relu"), gluon.nn.Dense(4, in_units=16))
        net.initialize(mx.init.Normal(0.5))
        self.net = net
        self.policy = policy
        self.seed = seed
        self.trainer = Trainer(net, "sgd", {"learning_rate": 0.1, "momentum": 0.9}, policy=policy)
        mx.random.seed(1234)
        self.x = nd.random.normal(shape=(8, 8))
        self.y = nd.random.normal(shape=(8, 4))
        self.loss_fn = gluon.loss.L2Loss()

    def _named(self) -> dict[str, gluon.Parameter]:
        return params_with_prefix(self.net)

    def step(self, inject_inf: bool = False) -> float:
        """One forward/backward/step on the fixed batch; the unscaled loss."""
        with autograd.record():
            # O3 outputs bfloat16; the loss against float32 targets is taken in float32
            loss = self.loss_fn(cast(self.net(self.x), FLOAT32), self.y).mean()
            with self.trainer.scale_loss(loss) as scaled:
                autograd.backward(scaled)
        if inject_inf:
            self.net[0].weight.grad()[0, 0] = float("inf")
        self.trainer.step(1)
        return float(loss.asscalar())

    def params(self) -> dict[str, list[float]]:
        """Model parameters as float32 values."""
        return {k: _values(p.data()) for k, p in self._named().items()}

    def master_params(self) -> dict[str, list[float]]:
        """The optimizer's masters (the parameter itself where there is no copy); under
        ``master=kahan`` the working masters hold ``w + c`` between steps."""
        master_for = ensure_prepared(self.trainer._mixprec, self.trainer).master_for
        return {k: _values(master_for(p).data()) for k, p in self._named().items()}

    def optimizer_state(self) -> dict[str, list[float]]:
        """Momentum buffers, by parameter name; under a low-bit ``state`` as kept between
        steps: the codes and the block absmax; under ``state=bfloat16`` the bfloat16 values,
        widened."""
        states = self.trainer._updaters[0].states
        out = {}
        for key, param in self._named().items():
            state = states.get(self.trainer._param2idx[param.name])
            for j, array in enumerate(_arrays(state)):
                out[f"{key}.{j}"] = _values(array)
        return out

    def loss_scale(self) -> float:
        """The scale the next step uses."""
        return self.trainer.loss_scale

    def skipped_steps(self) -> int:
        """Steps skipped so far."""
        return self.trainer.skipped_steps

    def checkpoint(self) -> bytes:
        """``net.save_parameters`` and ``trainer.save_states`` files, in one blob."""
        with tempfile.TemporaryDirectory() as tmp:
            params, states = os.path.join(tmp, "net.params"), os.path.join(tmp, "trainer.states")
            self.net.save_parameters(params)
            self.trainer.save_states(states)
            files = {"params": _read(params), "states": _read(states)}
            return json.dumps(
                {k: base64.b64encode(v).decode("ascii") for k, v in files.items()}
            ).encode()

    def restore(self, blob: bytes) -> None:
        """Load a checkpoint blob the way a user resumes."""
        files = {k: base64.b64decode(v) for k, v in json.loads(blob).items()}
        with tempfile.TemporaryDirectory() as tmp:
            params, states = os.path.join(tmp, "net.params"), os.path.join(tmp, "trainer.states")
            _write(params, files["params"])
            _write(states, files["states"])
            self.net.load_parameters(params)
            self.trainer.load_states(states)

    def saved_param_dtypes(self) -> set[str]:
        """Dtypes in the file ``net.save_parameters`` writes."""
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "net.params")
            self.net.save_parameters(path)
            return {dtype_name(v.dtype) for v in nd.load(path).values()}


def _values(array: nd.NDArray) -> list[float]:
    return [float(v) for v in cast(array, FLOAT32).asnumpy().ravel()]


def _arrays(state: Any) -> list[nd.NDArray]:
    if isinstance(state, nd.NDArray):
        return [state]
    if isinstance(state, LowBitArray):  # codes as floats: exact (uint8)
        return [state.codes.astype("float32"), state.absmax]
    if isinstance(state, (list, tuple)):
        return [a for s in state for a in _arrays(s)]
    return []


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
