"""Compensated bfloat16 weights: the NumPy reference's arithmetic, bit for bit, and what
it buys in training."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tests._models import batch, loss_fn, params

import mixprec.jax as mpj
from mixprec_jax.compensation import kahan_split, round_with_noise

reference = pytest.importorskip("mixprec_numpy.compensation")


def _values(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(4096).astype(np.float32) * np.float32(10.0) ** rng.integers(-8, 8, 4096)
    x[:4] = [np.nan, 3e38, -0.0, 1.0 + 2.0**-8]  # NaN, near the top, -0, a tie
    return x.astype(np.float32)


def _bits(x: object) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def test_kahan_split_is_the_numpy_reference() -> None:
    x = _values(0)
    w, c = kahan_split(jnp.asarray(x))
    ref_w, ref_c = reference.kahan_split(x)
    np.testing.assert_array_equal(_bits(w.astype(jnp.float32)), _bits(ref_w))
    np.testing.assert_array_equal(_bits(c.astype(jnp.float32)), _bits(ref_c))


def test_stochastic_rounding_is_the_numpy_reference_given_the_same_noise() -> None:
    x = _values(1)
    rng, same = np.random.default_rng(7), np.random.default_rng(7)
    ref = reference.round_stochastic_to_bfloat16(x, rng)
    noise = same.integers(0, 1 << 16, size=x.shape, dtype=np.uint32)  # the numbers it drew
    got = round_with_noise(jnp.asarray(x), jnp.asarray(noise))
    np.testing.assert_array_equal(_bits(got.astype(jnp.float32)), _bits(ref))


@functools.cache
def _compiled(policy: str, lr: float) -> tuple[mpj.Optimizer, object]:
    opt = mpj.Optimizer(optax.sgd(lr), policy=policy)
    return opt, opt.make_step(loss_fn)


def _train(policy: str, lr: float, steps: int = 30) -> tuple[mpj.Optimizer, mpj.State]:
    opt, step = _compiled(policy, lr)
    state, b = opt.init(params()), batch()
    for _ in range(steps):
        _, state, _ = step(state, b)  # type: ignore[operator]
    return opt, state


def test_small_updates_survive_under_kahan_and_sr_but_round_away_in_plain_bfloat16() -> None:
    """With updates far below half a bfloat16 spacing, O3-bf16 weights never move; kahan's
    ``w + c`` follows the float32 masters of O2-bf16, and sr moves the weights."""
    lr = 1e-5
    o2, masters = _train("O2-bf16", lr)
    o3, plain = _train("O3-bf16", lr)
    kahan_opt, kahan = _train("O3-bf16-kahan", lr)
    sr_opt, sr = _train("O3-bf16-sr", lr)
    start = jax.tree_util.tree_leaves(mpj.Optimizer(optax.sgd(lr), "O3-bf16").init(params()))
    kernel = lambda tree: np.asarray(jax.tree_util.tree_leaves(tree)[1], np.float32)  # noqa: E731
    assert np.array_equal(kernel(o3.params(plain)), np.asarray(start[1], np.float32))
    moved = kernel(o2.params(masters)) - np.asarray(params()["params"]["Dense_0"]["kernel"])
    kahan_moved = kernel(kahan_opt.params(kahan)) - np.asarray(start[1], np.float32)
    assert np.abs(moved).max() > 0
    np.testing.assert_allclose(kahan_moved, moved, rtol=0.05, atol=2e-8)
    assert not np.array_equal(kernel(sr_opt.params(sr)), np.asarray(start[1], np.float32))
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(kahan.weights)} == {
        jnp.dtype(jnp.bfloat16)
    }


def test_stochastic_rounding_is_seeded() -> None:
    a = _train("O3-bf16-sr", 1e-5, steps=3)[1]  # two runs of one compiled step
    b = _train("O3-bf16-sr", 1e-5, steps=3)[1]
    for x, y in zip(jax.tree_util.tree_leaves(a.weights), jax.tree_util.tree_leaves(b.weights),
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
