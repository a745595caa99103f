"""The JAX backend's entry into mixprec's conformance suite (:mod:`mixprec.testing`).

The adapter runs each op family the plugin sees (a flax module or a function called by
name) under :func:`~mixprec_jax.policy_scope` and reports the dtype of what it returned
(for a module, as it computed it, before an O2 island casts it back);
the trainer is a small flax MLP with momentum SGD whose jitted step is compiled once per
policy and shared by every trainer of that policy (steps are pure functions).

A functional step has no moment "after the backward pass" to write an inf into a gradient,
so the trainer's loss routes the first kernel through :func:`poison`, an identity whose
backward pass adds ``inf`` to one gradient element when the batch's flag is set: the step's
own overflow check then sees exactly what the imperative backends' injection produces.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from mixprec.errors import PolicyError
from mixprec.kit import LOWBIT_FORMATS, Policy, StateFormat, lowbit_format
from mixprec_jax import intercept, lowbit
from mixprec_jax.casting import PyTree, cast, cast_floating, dtype_name, jax_dtype
from mixprec_jax.devices import check_dtype, resolve_policy
from mixprec_jax.optimizer import Optimizer
from mixprec_jax.state import State
from mixprec_jax.trees import leaf_names

__all__ = ["SUPPORTED_OPS", "JaxConformanceAdapter", "JaxConformanceTrainer", "poison"]


# ------------------------------------------------------------------------------------------
# Single ops
# ------------------------------------------------------------------------------------------


class _Outer(nn.Module):
    """A root around the layer under test, so the layer is not the model's boundary (which
    casts to the policy's output dtype)."""

    layer: nn.Module

    @nn.compact
    def __call__(self, *args: Any) -> Any:
        return self.layer(*args)


def _modules() -> dict[str, tuple[Callable[[], nn.Module], Callable[[jax.Array], tuple[Any, ...]]]]:
    x4 = lambda x: (x.reshape(1, 4, 3, 1),)  # noqa: E731 - (batch, height, width, features)
    return {
        "linear": (lambda: nn.Dense(2), lambda x: (x,)),
        "conv": (lambda: nn.Conv(2, (2, 2)), x4),
        "conv_transpose": (lambda: nn.ConvTranspose(2, (2, 2)), x4),
        "attention": (lambda: nn.MultiHeadDotProductAttention(1), lambda x: (x[None],)),
        "rnn_cell": (lambda: nn.GRUCell(3), lambda x: (x, x)),
        "batch_norm": (lambda: nn.BatchNorm(use_running_average=True), lambda x: (x,)),
        "layer_norm": (lambda: nn.LayerNorm(), lambda x: (x,)),
        "group_norm": (lambda: nn.GroupNorm(num_groups=1), lambda x: (x,)),
        "instance_norm": (lambda: nn.InstanceNorm(), x4),
        "embedding": (lambda: nn.Embed(5, 3), lambda x: (jnp.array([0, 1, 2, 4]),)),
        "dropout": (lambda: nn.Dropout(0.5, deterministic=True), lambda x: (x,)),
    }


def _functions() -> dict[str, Callable[[jax.Array], Any]]:
    labels = jnp.array([0, 1, 2, 0])
    return {
        "matmul": lambda x: jnp.matmul(x, x.T),
        "bmm": lambda x: jnp.matmul(x[None], x.T[None]),
        "softmax": lambda x: jax.nn.softmax(x),
        "log_softmax": lambda x: jax.nn.log_softmax(x),
        "logsumexp": lambda x: jax.nn.logsumexp(x, axis=-1),
        "exp": lambda x: jnp.exp(x),
        "log": lambda x: jnp.log(jnp.abs(x) + 1),
        "pow": lambda x: jnp.power(x, 2.0),
        "sum": lambda x: jnp.sum(x),
        "prod": lambda x: jnp.prod(x),
        "cumsum": lambda x: jnp.cumsum(x),
        "norm": lambda x: jnp.linalg.norm(x),
        "cat": lambda x: jnp.concatenate([x, x]),
        "stack": lambda x: jnp.stack([x, x]),
        "where": lambda x: jnp.where(x > 0, x, x),
        "tanh": lambda x: jnp.tanh(x),
        "relu": lambda x: jax.nn.relu(x),
        "gelu": lambda x: jax.nn.gelu(x),
        "silu": lambda x: jax.nn.silu(x),
        "sigmoid": lambda x: jax.nn.sigmoid(x),
        "max_pool": lambda x: nn.max_pool(x.reshape(1, 4, 3, 1), (2, 2)),
        "avg_pool": lambda x: nn.avg_pool(x.reshape(1, 4, 3, 1), (2, 2)),
        "cross_entropy": lambda x: optax.softmax_cross_entropy_with_integer_labels(x, labels),
        "mse_loss": lambda x: optax.squared_error(x, x),
        "smooth_l1_loss": lambda x: optax.huber_loss(x, x),
        "kl_div": lambda x: optax.kl_divergence(x, x),
        "binary_cross_entropy_with_logits": lambda x: optax.sigmoid_binary_cross_entropy(x, x),
    }


SUPPORTED_OPS: tuple[str, ...] = (*_modules(), *_functions())
"""Every op family the adapter runs: those the plugin sees (intercept's tables)."""


@functools.cache
def _initialised(op: str) -> tuple[nn.Module, PyTree, tuple[Any, ...]]:
    make, args_of = _modules()[op]
    outer = _Outer(make())
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 3)), jnp.float32)
    variables = outer.init(jax.random.key(0), *args_of(x))
    return outer, variables, args_of(x)


class JaxConformanceAdapter:
    """Implements :class:`mixprec.testing.ConformanceAdapter` for the JAX backend."""

    name = "jax"
    master_strategies = ("kahan", "stochastic")
    state_dtypes = LOWBIT_FORMATS  # not bfloat16: optax allocates the state
    device = "cpu"

    def supported_ops(self) -> tuple[str, ...]:
        return SUPPORTED_OPS

    def op_module_class(self, op: str) -> tuple[str, ...] | None:
        """The flax module classes an op runs in (class rules apply), None for functions."""
        if op not in _modules():
            return None
        return intercept.module_classes(_initialised(op)[0].layer)

    def op_dtype(self, policy: Policy, op: str, input_dtype: str) -> str:
        policy = resolve_policy(policy, self.device)
        check_dtype(input_dtype, self.device, "the op's inputs")
        # Dtypes are static in JAX: tracing abstractly (jax.eval_shape) runs the plugin's
        # interception exactly as a jitted step does, without compiling a kernel per case.
        x = jax.ShapeDtypeStruct((4, 3), jax_dtype(input_dtype))
        if op in _modules():
            outer, variables, args = _initialised(op)

            def run(variables: PyTree, *args: Any) -> Any:
                variables = cast_floating(variables, input_dtype)
                return outer.apply(variables, *(cast(a, input_dtype) for a in args))

            with intercept.policy_scope(policy) as scope:
                jax.eval_shape(run, variables, *args)
            computed = scope.modules["layer"].output  # before an island's cast back
            assert computed is not None
            return computed
        if op in _functions():
            with intercept.policy_scope(policy):
                out = jax.eval_shape(_functions()[op], x)
            return dtype_name(jax.tree_util.tree_leaves(out)[0])
        raise PolicyError(f"the JAX backend has no {op!r} op; it has {', '.join(SUPPORTED_OPS)}")

    def make_trainer(self, policy: Policy, seed: int = 0) -> JaxConformanceTrainer:
        return JaxConformanceTrainer(policy, seed)

    def lowbit_quantize(
        self, state: str, signed: bool, values: list[float]
    ) -> tuple[list[int], list[float], list[float]]:
        """``values`` encoded and decoded again by :mod:`mixprec_jax.lowbit`'s codec."""
        fmt = lowbit_format(state)
        q, decoded = _codec(fmt, signed)(jnp.asarray(values, jnp.float32))
        return (
            np.asarray(q.codes).tolist(),
            np.asarray(q.absmax).tolist(),
            np.asarray(decoded).tolist(),
        )


@functools.cache
def _codec(fmt: StateFormat, signed: bool) -> Callable[[jax.Array], Any]:
    # one compiled program per case instead of a compiled kernel per operation
    def run(x: jax.Array) -> tuple[lowbit.QuantizedArray, jax.Array]:
        q = lowbit.quantize(x, fmt, signed)
        return q, lowbit.dequantize(q, fmt, signed, x.shape)

    return jax.jit(run)  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------------------
# The trainer
# ------------------------------------------------------------------------------------------


@jax.custom_vjp
def poison(w: jax.Array, flag: jax.Array) -> jax.Array:
    """``w`` itself; its backward pass adds ``inf`` to the first gradient element when
    ``flag`` is positive (the suite's ``inject_inf``)."""
    return w


def _poison_fwd(w: jax.Array, flag: jax.Array) -> tuple[jax.Array, jax.Array]:
    return w, flag


def _poison_bwd(flag: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    bad = jnp.where(flag > 0, jnp.inf, 0.0).astype(g.dtype)
    return g.at[(0,) * g.ndim].add(bad), jnp.zeros_like(flag)


poison.defvjp(_poison_fwd, _poison_bwd)


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Dense(8)(x))
        return nn.Dense(3)(x)


_MODEL = _MLP()


def _loss(params: PyTree, batch: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
    x, y, flag = batch
    first = params["params"]["Dense_0"]
    poisoned = {**first, "kernel": poison(first["kernel"], flag)}
    params = {"params": {**params["params"], "Dense_0": poisoned}}
    logits = _MODEL.apply(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@functools.cache
def _compiled(policy: Policy, seed: int) -> tuple[Optimizer, Callable[..., Any]]:
    # one optimizer and one compiled step per policy: steps are pure, trainers share them
    opt = Optimizer(optax.sgd(0.05, momentum=0.9), policy, device="cpu", seed=seed)
    return opt, opt.make_step(_loss)


class JaxConformanceTrainer:
    """Implements :class:`mixprec.testing.ConformanceTrainer`: a 6-8-3 flax MLP, momentum
    SGD, one fixed batch."""

    def __init__(self, policy: Policy, seed: int = 0) -> None:
        resolve_policy(policy, "cpu")  # refusals first, before anything is compiled
        rng = np.random.default_rng(seed)
        self.x = jnp.asarray(rng.standard_normal((16, 6)), jnp.float32)
        self.y = jnp.asarray(rng.integers(0, 3, 16))
        self.opt, self._step = _compiled(policy, seed)
        params = _MODEL.init(jax.random.key(seed), self.x)
        self.state: State = self.opt.init(params)

    def step(self, inject_inf: bool = False) -> float:
        flag = jnp.float32(1.0 if inject_inf else 0.0)
        loss, self.state, _ = self._step(self.state, (self.x, self.y, flag))
        return float(loss)

    def _flat(self, tree: PyTree) -> dict[str, list[float]]:
        leaves = jax.tree_util.tree_leaves(tree)
        return {
            name: np.asarray(leaf, np.float32).ravel().tolist()
            for name, leaf in zip(leaf_names(tree), leaves, strict=True)
        }

    def params(self) -> dict[str, list[float]]:
        return self._flat(self.opt.model_params(self.state))

    def master_params(self) -> dict[str, list[float]]:
        return self._flat(self.opt.params(self.state))

    def optimizer_state(self) -> dict[str, list[float]]:
        return self._flat(self.state.opt_state)

    def loss_scale(self) -> float:
        return float(self.state.loss_scale.scale)

    def skipped_steps(self) -> int:
        return int(self.state.skipped_steps)

    def checkpoint(self) -> bytes:
        buffer = io.BytesIO()
        self.opt.save(buffer, self.state)
        return buffer.getvalue()

    def restore(self, blob: bytes) -> None:
        self.state = self.opt.load(io.BytesIO(blob), like=self.state)

    def saved_param_dtypes(self) -> set[str]:
        buffer = io.BytesIO()
        self.opt.save_params(buffer, self.state)
        buffer.seek(0)
        with np.load(buffer, allow_pickle=False) as saved:
            return {str(saved[name].dtype) for name in saved.files if name != "__meta__"}
