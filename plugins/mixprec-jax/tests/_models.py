"""Small flax models and batches shared by the tests."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax


class MLP(nn.Module):
    """6 -> 16 -> 3, with a named head."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(3, name="head")(nn.relu(nn.Dense(16)(x)))


def batch(seed: int = 0, n: int = 32) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((n, 6)), jnp.float32), jnp.asarray(rng.integers(0, 3, n))


MODEL = MLP()


def params(seed: int = 0) -> Any:
    return MODEL.init(jax.random.key(seed), batch()[0])


def loss_fn(p: Any, b: Any) -> jax.Array:
    """Cross-entropy; a third batch element ``blow_up`` scales the loss by 1e30 when 1."""
    x, y, *rest = b
    loss = optax.softmax_cross_entropy_with_integer_labels(MODEL.apply(p, x), y).mean()
    return loss * (1.0 + jnp.max(rest[0]) * 1e30) if rest else loss  # a scalar or a shard of one
