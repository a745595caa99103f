"""Checkpoints: the state round-trips through a plain array save and resumes bit for bit."""

from __future__ import annotations

import io
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tests._models import batch, loss_fn, params

import mixprec.jax as mpj
from mixprec.errors import CheckpointError

OVERFLOWS = (False, True, False, False, True, False, False, False)


def _run(step: object, state: mpj.State, overflows: tuple[bool, ...]) -> tuple[list, mpj.State]:
    x, y = batch()
    losses = []
    for overflow in overflows:
        loss, state, _ = step(state, (x, y, jnp.int32(overflow)))  # type: ignore[operator]
        losses.append(np.asarray(loss))
    return losses, state


def _same(a: object, b: object) -> None:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(
            np.atleast_1d(np.asarray(x)).view(np.uint8), np.atleast_1d(np.asarray(y)).view(np.uint8)
        )


@pytest.mark.parametrize(
    "policy", ["O2,loss_scale=dynamic(init=1024,interval=2,hysteresis=2)", "O3-bf16-sr"]
)
def test_plain_numpy_savez_of_the_leaves_resumes_bit_for_bit(policy: str, tmp_path: Path) -> None:
    """numpy.savez(*leaves) and tree_unflatten: bfloat16 leaves come back as raw 2-byte
    values, viewed as the template's dtype, and training continues identically."""
    opt = mpj.Optimizer(optax.adamw(1e-2), policy=policy)
    step = opt.make_step(loss_fn)
    _, state = _run(step, opt.init(params()), OVERFLOWS[:4])
    leaves, treedef = jax.tree_util.tree_flatten(state)
    np.savez(tmp_path / "state.npz", *[np.asarray(leaf) for leaf in leaves])
    with np.load(tmp_path / "state.npz", allow_pickle=False) as saved:
        raw = [saved[f"arr_{i}"] for i in range(len(leaves))]
    template = jax.tree_util.tree_leaves(opt.init(params()))
    resumed = treedef.unflatten(
        [jnp.asarray(r.view(t.dtype)) for r, t in zip(raw, template, strict=True)]
    )
    _same(state, resumed)
    losses_a, a = _run(step, state, OVERFLOWS[4:])
    losses_b, b = _run(step, resumed, OVERFLOWS[4:])
    _same(a, b)
    assert [x.tobytes() for x in losses_a] == [x.tobytes() for x in losses_b]
    assert int(b.skipped_steps) == 2


def test_optimizer_save_and_load_checks_the_policy_and_the_arrays(tmp_path: Path) -> None:
    opt = mpj.Optimizer(optax.adam(1e-2), policy="O3-bf16-kahan")
    step = opt.make_step(loss_fn)
    _, state = _run(step, opt.init(params()), OVERFLOWS[:3])
    opt.save(tmp_path / "ckpt.npz", state)
    resumed = opt.load(tmp_path / "ckpt.npz", like=opt.init(params()))
    _same(state, resumed)
    other = mpj.Optimizer(optax.adam(1e-2), policy="O3-bf16-sr")
    with pytest.raises(CheckpointError, match="different policy"):
        other.load(tmp_path / "ckpt.npz", like=other.init(params()))
    wider = mpj.Optimizer(optax.adam(1e-2), policy="O3-bf16-kahan")
    bigger = jax.tree_util.tree_map(lambda x: jnp.concatenate([x, x]), params())
    with pytest.raises(CheckpointError, match=r"Dense_0\.bias: the checkpoint has bfloat16\[16\]"):
        wider.load(tmp_path / "ckpt.npz", like=wider.init(bigger))
    with pytest.raises(CheckpointError, match="not a mixprec-jax checkpoint"):
        opt.load(io.BytesIO(b"not a file"), like=state)


def test_saved_params_are_float32_masters(tmp_path: Path) -> None:
    opt = mpj.Optimizer(optax.adam(1e-2), policy="O2-bf16")
    state = opt.init(params())
    opt.save_params(tmp_path / "params.npz", state)
    with np.load(tmp_path / "params.npz", allow_pickle=False) as saved:
        dtypes = {str(saved[n].dtype) for n in saved.files if n != "__meta__"}
        kernel = saved["params.Dense_0.kernel"]
    assert dtypes == {"float32"}
    np.testing.assert_array_equal(kernel, np.asarray(params()["params"]["Dense_0"]["kernel"]))
