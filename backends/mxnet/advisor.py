"""``mixprec.mxnet.advise``: which policy for this Gluon net on this machine, and which blocks
to keep in float32.

Each candidate trains a ``copy.deepcopy`` of the net with its own :class:`Trainer` (the
optimizer is copied too when an instance is given): the user's net and optimizer are never
touched. A candidate whose Trainer or step raises (bfloat16 on a CPU without oneDNN bf16
kernels, float16 on a CPU) is reported as ``failed: <reason>``. The run itself is
:func:`mixprec.advisor.run_advice`.

Each run's optimizer state between steps is the Gluon updater's (``updater.states``, the
first context's: every context keeps its own copy), counted by :func:`updater_state_bytes`.
A low-bit state (``state=int8``) the Trainer refuses is not offered (a note says why).

Block sensitivity runs the copies imperatively (not hybridized) so that forward hooks see
every child; the gradient error is that of each block's own parameters (MXNet gives no
gradient of an intermediate output), zero for blocks without parameters.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

from mixprec.kit import (
    FLOAT32,
    RSS_MEASURE,
    AdviceError,
    AdviceReport,
    Capabilities,
    ModuleSensitivity,
    get_policy,
    run_advice,
)

from .bf16_kernels import quiet_native_log
from .devices import capabilities, device_key
from .diagnostics import underflow_fraction
from .dtypes import cast
from .trainer import Trainer

__all__ = ["advise", "updater_state_bytes"]

LossFn = Callable[[Any, Any], Any]


def _scalar(loss: Any) -> float:
    return float(cast(loss, FLOAT32).mean().asscalar())  # asscalar waits for the device


def _nbytes(value: Any) -> int:
    """Bytes of the arrays in one updater state (an array, or tuples, lists and dicts of
    them, as MXNet's optimizers make them; a low-bit state's array says its own ``nbytes``:
    codes and absmax)."""
    if isinstance(value, mx.nd.NDArray):
        return int(value.size) * np.dtype(value.dtype).itemsize if value.ndim else 0
    held = getattr(value, "nbytes", None)
    if isinstance(held, int):
        return held
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    return 0


def updater_state_bytes(trainer: gluon.Trainer) -> tuple[int, int] | None:
    """``(bytes, parameters)``: the bytes of the optimizer state the trainer's first updater
    keeps between steps, and the elements of the parameters it trains (``grad_req`` not
    ``"null"``); None before the first step made the updater."""
    updaters = getattr(trainer, "_updaters", None)
    if not updaters:
        return None
    total = sum(_nbytes(state) for state in updaters[0].states.values())
    params = sum(int(np.prod(p.shape)) for p in trainer._params if p.grad_req != "null")
    return total, params


class _Trainee:
    def __init__(self, net: gluon.Block, trainer: Trainer, loss_fn: LossFn) -> None:
        self.net, self.trainer, self.loss_fn = net, trainer, loss_fn

    def step(self, batch: Any) -> float:
        with quiet_native_log():  # oneDNN's C++ log of a float32 island: not the user's news
            return self._step(batch)

    def _step(self, batch: Any) -> float:
        inputs, target = batch
        with autograd.record():
            loss = self.loss_fn(self.net(inputs), target)
            with self.trainer.scale_loss(loss) as scaled:
                autograd.backward(scaled)
        self.trainer.step(inputs.shape[0])
        return _scalar(loss)

    def loss_scale(self) -> float:
        return float(self.trainer.loss_scale)

    def skipped_steps(self) -> int:
        return int(self.trainer.skipped_steps)

    def underflow_fraction(self) -> float | None:
        fractions = underflow_fraction(self.trainer, self.trainer.policy.compute)
        return statistics.fmean(fractions.values()) if fractions else None

    def peak_memory(self) -> int | None:
        return None

    def state_bytes(self) -> tuple[int, int] | None:
        return updater_state_bytes(self.trainer)


def _blocks(net: gluon.Block, path: str = "") -> Iterator[tuple[str, gluon.Block]]:
    """``(path, block)`` for every block, named as module rules name them (``"0.1"``)."""
    yield path, net
    for name, child in net._children.items():
        yield from _blocks(child, f"{path}.{name}" if path else name)


def _first(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return next((v for v in value if isinstance(v, mx.nd.NDArray)), None)
    return value if isinstance(value, mx.nd.NDArray) else None


def _rel_error(low: Any, ref: Any) -> float:
    """``|low - ref| / |ref|`` over the arrays; inf where low is not finite but ref is."""
    if low is None or ref is None:
        return 0.0
    a, b = np.asarray(low, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if a.shape != b.shape:
        return 0.0
    if not np.isfinite(a).all():
        return float("inf") if np.isfinite(b).all() else 0.0
    return float(np.linalg.norm(a - b) / max(float(np.linalg.norm(b)), 1e-30))


def _joined(grads: list[Any] | None) -> Any:
    """A module's parameter gradients as one vector (None without any), so the module's
    gradient error is one relative error. Per parameter, the largest error read ~1e3 for a
    convolution followed by BatchNorm: BatchNorm cancels the convolution's bias, whose float32
    gradient is then rounding noise (~1e-9) that bfloat16 rounds differently."""
    if not grads:
        return None
    return np.concatenate([np.ravel(g) for g in grads])


def _host(array: Any) -> Any:
    # amp_cast, not astype: MXNet 1.9's Cast fails on a bfloat16 array in oneDNN's blocked
    # layout (a Conv2D's output with 16+ channels on an AVX512-BF16 CPU): "The size of
    # NDArray doesn't match the requested MKLDNN memory desc"
    return cast(array, FLOAT32).asnumpy()


class _MxTarget:
    backend = "mxnet"

    def __init__(
        self, net: gluon.Block, optimizer: Any, params: dict[str, Any], loss_fn: LossFn, seed: int
    ) -> None:
        self.net, self.optimizer, self.params, self.loss_fn, self.seed = (
            net, optimizer, params, loss_fn, seed,
        )  # fmt: skip
        ctx = next(iter(net.collect_params().values())).list_ctx()[0]
        self.device = device_key(ctx)

    def capabilities(self) -> Capabilities:
        return capabilities()

    def memory_measure(self) -> str:
        return RSS_MEASURE

    def _copy(self, policy: str) -> tuple[gluon.Block, Trainer]:
        mx.random.seed(self.seed)
        net = copy.deepcopy(self.net)
        for param in net.collect_params().values():
            if param.grad_req != "null":  # deepcopy drops autograd's marks: attach fresh grads
                param._init_grad()
        optimizer = (
            self.optimizer if isinstance(self.optimizer, str) else copy.deepcopy(self.optimizer)
        )
        return net, Trainer(net, optimizer, dict(self.params), policy=policy)

    def no_sensitivity_reason(self, policy: str) -> str | None:
        """Why :meth:`sensitivity` has no rows under ``policy`` (the report's note)."""
        if get_policy(policy).casts_ops and isinstance(self.net, gluon.HybridBlock):
            return (
                "MXNet's O1 casts ops inside the hybridized graph, where Gluon's block hooks "
                "do not fire, so no block can be measured under it; name O2-bf16 among the "
                "candidates for per-block rows in the same compute dtype"
            )
        return None

    def start(self, policy: str) -> _Trainee:
        net, trainer = self._copy(policy)
        if isinstance(net, gluon.HybridBlock):
            net.hybridize(static_alloc=True)
        return _Trainee(net, trainer, self.loss_fn)

    def _measure(self, policy: str, batch: Any) -> dict[str, Any]:
        net, trainer = self._copy(policy)
        scale = float(trainer.loss_scale) if trainer.scaler.enabled else 1.0
        seen: dict[str, tuple[Any, Any, str]] = {}
        handles = []
        for name, block in _blocks(net):
            if not name:
                continue

            def hook(b: Any, args: Any, out: Any, name: str = name) -> None:
                if name not in seen and _first(args) is not None and _first(out) is not None:
                    seen[name] = (_host(_first(args)), _host(_first(out)), type(b).__name__)

            handles.append(block.register_forward_hook(hook))
        inputs, target = batch
        try:
            with autograd.record():
                loss = cast(self.loss_fn(net(inputs), target), FLOAT32) * scale
            loss.backward()
        finally:
            for handle in handles:
                handle.detach()
        grads: dict[str, list[Any]] = {}
        for name, block in _blocks(net):
            own = [p for p in block._reg_params.values() if p.grad_req != "null"]
            grads[name] = [_host(p.grad()) / scale for p in own]
        return {"acts": seen, "grads": grads}

    def sensitivity(self, policy: str, batch: Any) -> list[ModuleSensitivity]:
        with quiet_native_log():
            ref, low = self._measure("O0", batch), self._measure(policy, batch)
        rows = []
        for name, (inp, out, cls) in low["acts"].items():
            ref_in, ref_out, _ = ref["acts"].get(name, (None, None, ""))
            out_err, in_err = _rel_error(out, ref_out), _rel_error(inp, ref_in)
            added = 0.0 if out_err == in_err else max(0.0, out_err - in_err)
            grad_err = _rel_error(_joined(low["grads"].get(name)), _joined(ref["grads"].get(name)))
            rows.append(ModuleSensitivity(name, cls, out_err, added, grad_err))
        return rows


def advise(
    net: gluon.Block,
    optimizer: Any,
    optimizer_params: dict[str, Any] | None,
    batches: Sequence[tuple[Any, Any]],
    loss_fn: LossFn,
    candidates: Sequence[str] | None = None,
    steps: int = 20,
    *,
    warmup: int = 2,
    tolerance: float = 0.05,
    threshold: float = 0.01,
    max_rules: int = 3,
    max_skip_fraction: float = 0.2,
    seed: int = 0,
    progress: bool | None = None,
    objective: str = "speed",
    states: str | Sequence[str] | None = ("int8",),  # mixprec.advisor.run.DEFAULT_STATES
) -> AdviceReport:
    """Train short copies of ``net`` under each candidate policy and advise which to use.

    :param net: an initialized Gluon block, left untouched (each candidate trains a copy).
    :param optimizer: an optimizer name (``"adam"``) or an ``mx.optimizer.Optimizer``
        (copied for each candidate), as ``Trainer`` takes it.
    :param optimizer_params: its parameters, such as ``{"learning_rate": 1e-3}``.
    :param batches: ``(inputs, label)`` NDArray pairs, cycled for ``steps`` steps.
    :param loss_fn: ``loss_fn(net(inputs), label)`` gives the loss (per sample is fine).
    :param candidates: policies to try (``O0`` is always added); by default every built-in
        preset the net's context computes in. One that raises is reported as failed.
    :param seed: seeds MXNet's random generator before each copy.

    The other parameters (``objective`` and ``states`` among them) are those of
    ``mixprec.torch.advise``. A low-bit state the Trainer refuses is not offered: the
    report's notes say so.

    Example::

        import mxnet as mx
        from mxnet import gluon
        import mixprec.mxnet as mpx

        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Dense(64, activation="relu"), gluon.nn.Dense(2))
        net.initialize()
        x = mx.nd.random.normal(shape=(256, 20))
        batches = [(x[i : i + 64], x[i : i + 64, 0] > 0) for i in range(0, 256, 64)]
        net(batches[0][0])
        report = mpx.advise(net, "adam", {"learning_rate": 1e-3}, batches,
                            gluon.loss.SoftmaxCrossEntropyLoss(), ["O2-bf16"], 8)
        print(report.table())

    :returns: an :class:`~mixprec.kit.AdviceReport`; ``report.recommended`` is the policy.
    :raises AdviceError: bad arguments, before anything runs.
    """
    if not isinstance(net, gluon.Block):
        raise AdviceError(f"advise needs a gluon Block, got {type(net).__name__}")
    params = list(net.collect_params().values())
    if not params or any(p._data is None for p in params):
        raise AdviceError(
            "advise needs an initialized net with parameters; call net.initialize() and one "
            "forward pass (for deferred shapes) first"
        )
    target = _MxTarget(net, optimizer, dict(optimizer_params or {}), loss_fn, seed)
    return run_advice(
        target,
        list(batches),
        candidates=candidates,
        steps=steps,
        warmup=warmup,
        tolerance=tolerance,
        threshold=threshold,
        max_rules=max_rules,
        max_skip_fraction=max_skip_fraction,
        progress=progress,
        objective=objective,
        states=states,
    )
