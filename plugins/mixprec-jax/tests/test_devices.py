"""Several devices: make_step(loss_fn, axis_name=...) under jax.pmap and shard_map.

conftest.py forces two CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from tests._models import batch, loss_fn, params

import mixprec.jax as mpj

pytestmark = pytest.mark.skipif(jax.device_count() < 2, reason="needs two (host) devices")


def _replicate(tree: object) -> object:
    return jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), tree)


def _sharded(blow_up: tuple[int, int]) -> tuple[jax.Array, ...]:
    x, y = batch(n=32)
    return x.reshape(2, 16, 6), y.reshape(2, 16), jnp.asarray(blow_up, jnp.int32)


def test_an_overflow_on_one_device_skips_the_step_on_both() -> None:
    opt = mpj.Optimizer(optax.adam(1e-2), policy="O2")  # float16, dynamic loss scale
    step = jax.pmap(opt.make_step(loss_fn, axis_name="batch"), axis_name="batch")
    state = _replicate(opt.init(params()))
    _, state, info = step(state, _sharded((0, 0)))
    before = jax.tree_util.tree_map(np.asarray, state)
    _, state, info = step(state, _sharded((0, 1)))  # only device 1's batch explodes
    assert np.asarray(info.skipped).tolist() == [True, True]
    for old, new in zip(jax.tree_util.tree_leaves(before.weights),
                        jax.tree_util.tree_leaves(state.weights), strict=True):  # fmt: skip
        np.testing.assert_array_equal(old, new)  # masters untouched on both devices
    for old, new in zip(jax.tree_util.tree_leaves(before.opt_state),
                        jax.tree_util.tree_leaves(state.opt_state), strict=True):  # fmt: skip
        np.testing.assert_array_equal(old, new)
    assert np.asarray(state.loss_scale.scale).tolist() == [2.0**15, 2.0**15]
    assert np.asarray(state.skipped_steps).tolist() == [1, 1]
    _, state, info = step(state, _sharded((0, 0)))
    assert not np.asarray(info.skipped).any()
    masters = [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(state.weights)]
    assert all(np.array_equal(m[0], m[1]) for m in masters), "devices drifted apart"


def test_two_devices_average_like_one_device_on_the_whole_batch() -> None:
    opt = mpj.Optimizer(optax.sgd(0.1), policy="O0")
    one = opt.make_step(loss_fn)
    two = jax.pmap(opt.make_step(loss_fn, axis_name="batch"), axis_name="batch")
    state = opt.init(params())
    loss1, single, _ = one(state, batch(n=32))
    loss2, double, _ = two(_replicate(state), _sharded((0, 0))[:2])
    np.testing.assert_allclose(np.asarray(loss2), [loss1, loss1], rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(single.weights),
                    jax.tree_util.tree_leaves(double.weights), strict=True):  # fmt: skip
        np.testing.assert_allclose(np.asarray(b), np.stack([a, a]), rtol=1e-5, atol=1e-7)


def test_shard_map_skips_together_too() -> None:
    mesh = jax.make_mesh((2,), ("batch",))
    opt = mpj.Optimizer(optax.adam(1e-2), policy="O2-bf16")
    step = jax.jit(
        jax.shard_map(
            opt.make_step(loss_fn, axis_name="batch", jit=False),
            mesh=mesh,
            in_specs=(P(), P("batch")),
            out_specs=(P(), P(), P()),
        )
    )
    split = jax.sharding.NamedSharding(mesh, P("batch"))

    def sharded(blow_up: list[int]) -> tuple[jax.Array, ...]:
        return jax.device_put((*batch(n=32), jnp.asarray(blow_up, jnp.int32)), split)

    state = jax.device_put(opt.init(params()), jax.sharding.NamedSharding(mesh, P()))
    _, state, info = step(state, sharded([0, 0]))
    assert not bool(info.skipped)
    before = [np.asarray(w) for w in jax.tree_util.tree_leaves(state.weights)]
    _, state, info = step(state, sharded([1, 0]))
    assert bool(info.skipped) and int(state.skipped_steps) == 1
    after = [np.asarray(w) for w in jax.tree_util.tree_leaves(state.weights)]
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
