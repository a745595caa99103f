"""Train a flax MLP or CNN on scikit-learn's digits under a mixprec policy, with optax.

    python plugins/mixprec-jax/examples/train_digits.py O2-bf16 cnn

The CNN has a BatchNorm, so it shows O2's class rule (BatchNorm kept float32) and the
``model_state`` path (flax's ``batch_stats``, kept as they were on a skipped step). The
tests run this file.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import mixprec.jax as mpj


class MLP(nn.Module):
    """64 -> 64 -> 10."""

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        x = nn.relu(nn.Dense(64)(x.reshape(x.shape[0], -1)))
        return nn.Dense(10, name="head")(x)


class CNN(nn.Module):
    """conv 3x3 (16) -> BatchNorm -> relu -> 2x2 average pool -> dense 10."""

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        x = nn.Conv(16, (3, 3))(x.reshape(x.shape[0], 8, 8, 1))
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        return nn.Dense(10, name="head")(x.reshape(x.shape[0], -1))


MODELS: dict[str, type[nn.Module]] = {"mlp": MLP, "cnn": CNN}


@dataclass
class Result:
    """What one run reports."""

    accuracy: float
    losses: list[float]
    skipped_steps: int
    loss_scale: float
    opt: Any
    state: Any
    report: str = ""
    skips: list[int] = field(default_factory=list)


def digits(seed: int = 0) -> tuple[np.ndarray, ...]:
    """Train and test splits of the digits (pixels scaled to [0, 1])."""
    data = load_digits()
    x = (data.images / 16.0).astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], data.target[order].astype(np.int32)
    return x[:1500], y[:1500], x[1500:], y[1500:]


def train(
    policy: str = "O2-bf16",
    model_name: str = "mlp",
    epochs: int = 3,
    batch_size: int = 100,
    inject_overflow_at: int | None = None,
    seed: int = 0,
) -> Result:
    """Train ``model_name`` under ``policy``; the step compiles once."""
    x_train, y_train, x_test, y_test = digits(seed)
    model = MODELS[model_name]()
    variables = model.init(jax.random.key(seed), jnp.asarray(x_train[:2]))
    params, batch_stats = {"params": variables["params"]}, variables.get("batch_stats")

    def loss_fn(params: Any, batch: Any, model_state: Any = None) -> Any:
        x, y, blow_up = batch
        if model_state is None:
            logits = model.apply(params, x)
            new_state = None
        else:
            logits, updates = model.apply(
                {**params, "batch_stats": model_state}, x, mutable=["batch_stats"]
            )
            new_state = updates["batch_stats"]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        # a batch whose loss explodes (blow_up = 1): its gradients overflow, the step skips
        loss = loss * (1.0 + blow_up * 1e30)
        return loss if model_state is None else (loss, new_state)

    opt = mpj.Optimizer(optax.adam(3e-3), policy=policy, seed=seed)
    state = opt.init(params, model_state=batch_stats)
    step = opt.make_step(loss_fn)
    losses, skips, n = [], [], 0
    for _ in range(epochs):
        for start in range(0, len(x_train) - batch_size + 1, batch_size):
            blow_up = jnp.int32(n == inject_overflow_at)  # an int: batches cast floats only
            batch = (x_train[start : start + batch_size], y_train[start : start + batch_size])
            loss, state, info = step(state, (*batch, blow_up))
            if bool(info.skipped):
                skips.append(n)
            else:
                losses.append(float(loss))
            n += 1
    with mpj.policy_scope(opt.policy):  # evaluate as training runs: same dtypes per module
        extra = {} if batch_stats is None else {"batch_stats": state.model_state}
        logits = model.apply({**opt.model_params(state), **extra}, x_test, train=False)
    accuracy = float(np.mean(np.argmax(np.asarray(logits, np.float32), -1) == y_test))
    return Result(
        accuracy=accuracy,
        losses=losses,
        skipped_steps=int(state.skipped_steps),
        loss_scale=float(state.loss_scale.scale),
        opt=opt,
        state=state,
        report=opt.dtype_report(state),
        skips=skips,
    )


def main(argv: list[str]) -> None:
    """``train_digits.py [POLICY] [mlp|cnn]``: train and print the accuracy and the report."""
    policy = argv[0] if argv else "O2-bf16"
    model_name = argv[1] if len(argv) > 1 else "mlp"
    result = train(policy, model_name)
    print(f"{model_name} under {result.opt.policy}: accuracy {result.accuracy:.1%}, "
          f"skipped {result.skipped_steps}, loss scale {result.loss_scale:g}")  # fmt: skip
    print(result.report)


if __name__ == "__main__":
    main(sys.argv[1:])
