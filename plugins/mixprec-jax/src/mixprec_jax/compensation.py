"""Compensated bfloat16 weights in JAX: the NumPy reference's arithmetic, traced.

:mod:`mixprec.compensated` describes the two strategies; ``mixprec_numpy.compensation``
is their readable reference, and each function here is the same line in ``jax.numpy``
(the tests check both give the same bits):

- ``kahan``: the working value is ``w + c`` in float32; after the optimizer's update
  ``w = nearest(v)`` and ``c = nearest(v - w)`` (:func:`kahan_split`);
- ``stochastic``: the working value is ``w``; after the update ``w = stochastic(v)``: add
  a uniform integer in ``[0, 2**16)`` to the low 16 bits of the float32 pattern and clear
  them (:func:`round_with_noise`). The noise comes from a ``jax.random`` key kept in the
  optimizer state (its raw ``uint32`` data, so a plain array save keeps it), split once
  per step, so a resumed run draws the same numbers.

Only bfloat16 leaves are compensated; float32 ones (modules a rule pins) are updated as
they are, as in the NumPy reference.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from mixprec.kit import KAHAN, STOCHASTIC
from mixprec_jax.casting import PyTree

__all__ = [
    "kahan_split",
    "new_key_data",
    "round_stochastic",
    "round_with_noise",
    "store",
    "working_values",
]


def round_with_noise(x: jax.Array, noise: jax.Array) -> jax.Array:
    """``x`` (float32) rounded to a bfloat16 neighbour by adding ``noise`` (uint32 in
    ``[0, 2**16)``) to its low 16 bits and clearing them; NaNs stay NaN.

    Example::

        import jax.numpy as jnp

        import mixprec.jax as mpj

        x = jnp.float32(1.0 + 2.0**-8)  # halfway between two bfloat16 neighbours
        assert float(mpj.round_with_noise(x, jnp.uint32(0))) == 1.0  # no noise: down
        assert float(mpj.round_with_noise(x, jnp.uint32(2**15))) == 1.0 + 2.0**-7  # up
    """
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    rounded = jax.lax.bitcast_convert_type((bits + noise) & jnp.uint32(0xFFFF0000), jnp.float32)
    return jnp.where(jnp.isnan(x), x, rounded).astype(jnp.bfloat16)


def round_stochastic(x: jax.Array, key: jax.Array) -> jax.Array:
    """``x`` rounded stochastically to bfloat16, the noise drawn from ``key``."""
    noise = jax.random.bits(key, x.shape, jnp.uint32) >> jnp.uint32(16)
    return round_with_noise(x, noise)


def kahan_split(value: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The bfloat16 weight and compensation that together hold the float32 ``value``:
    ``w = nearest(value)``, ``c = nearest(value - w)``.

    Example::

        import jax.numpy as jnp

        import mixprec.jax as mpj

        value = jnp.float32(1.0 + 2.0**-12)  # not a bfloat16 value
        w, c = mpj.kahan_split(value)
        assert float(w) == 1.0 and float(c) == 2.0**-12  # w + c holds it exactly
    """
    weight = value.astype(jnp.bfloat16)
    return weight, (value - weight.astype(jnp.float32)).astype(jnp.bfloat16)


def new_key_data(seed: int) -> jax.Array:
    """The raw ``uint32`` data of the key that seeds the stochastic rounding."""
    return jax.random.key_data(jax.random.key(seed))


def _compensated(w: jax.Array) -> bool:
    return bool(w.dtype == jnp.bfloat16)


def working_values(strategy: str, weights: PyTree, compensation: PyTree) -> PyTree:
    """The float32 values the optimizer updates: ``w + c`` under kahan, ``w`` otherwise."""
    if strategy == KAHAN:
        return jax.tree_util.tree_map(
            lambda w, c: w.astype(jnp.float32) + c.astype(jnp.float32) if _compensated(w) else w,
            weights,
            compensation,
        )
    return jax.tree_util.tree_map(lambda w: w.astype(jnp.float32), weights)


def store(
    strategy: str, weights: PyTree, updated: PyTree, key_data: Any
) -> tuple[PyTree, PyTree | None, Any]:
    """The updated float32 values stored back: (weights, kahan compensation, key data).

    Float32 leaves (pinned modules) keep the updated value as it is.
    """
    if strategy == KAHAN:
        pairs = jax.tree_util.tree_map(
            lambda w, v: kahan_split(v) if _compensated(w) else (v, jnp.zeros((), jnp.bfloat16)),
            weights,
            updated,
        )
        treedef = jax.tree_util.tree_structure(weights)
        leaves = treedef.flatten_up_to(pairs)
        new_w = treedef.unflatten([w for w, _ in leaves])
        new_c = treedef.unflatten([c for _, c in leaves])
        return new_w, new_c, key_data
    assert strategy == STOCHASTIC
    key, use = jax.random.split(jax.random.wrap_key_data(key_data))
    leaves, treedef = jax.tree_util.tree_flatten(weights)
    new = treedef.flatten_up_to(updated)
    keys = jax.random.split(use, max(len(leaves), 1))
    stored = [
        round_stochastic(v, k) if _compensated(w) else v
        for w, v, k in zip(leaves, new, keys, strict=False)
    ]
    return treedef.unflatten(stored), None, jax.random.key_data(key)
