"""The optimizer state and the step's report: plain pytrees of arrays.

Everything that changes from step to step lives in :class:`State`, a NamedTuple of
arrays, so it passes through ``jax.jit``, ``jax.pmap``, ``jax.lax.scan`` and a plain array
save; the :class:`~mixprec_jax.Optimizer` that made it holds only configuration.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from mixprec_jax.casting import PyTree

__all__ = ["ScaleArrays", "State", "StepInfo"]


class ScaleArrays(NamedTuple):
    """The loss scale's running fields on the device (:class:`mixprec.traced_scale.ScaleState`).

    Example::

        import jax.numpy as jnp
        import optax

        import mixprec.jax as mpj

        state = mpj.Optimizer(optax.sgd(0.1), policy="O2").init({"w": jnp.ones(3)})
        assert float(state.loss_scale.scale) == 65536.0  # O2's dynamic scale starts at 2**16
        assert int(state.loss_scale.good_steps) == 0
    """

    scale: jax.Array
    """float32: the scale the next step multiplies the loss by."""
    good_steps: jax.Array
    """int32: finite steps in a row since the last growth or overflow."""
    overflows_left: jax.Array
    """int32: overflows it still takes to back off."""


class State(NamedTuple):
    """What :meth:`~mixprec_jax.Optimizer.init` returns and each step replaces.

    The weights the optimizer keeps are float32 masters (policies with ``master=float32``),
    the parameters themselves (no master: float32 under O0/O1, low precision under O3), or
    compensated bfloat16 weights (``master=kahan``/``stochastic``).

    Example::

        import jax
        import optax

        import mixprec.jax as mpj

        params = {"w": jax.numpy.ones(3)}
        state = mpj.Optimizer(optax.sgd(0.1), policy="O2-bf16").init(params)
        assert state.weights["w"].dtype == jax.numpy.float32  # the float32 master
        assert int(state.steps) == int(state.skipped_steps) == 0
        assert float(state.loss_scale.scale) == 1.0  # bfloat16: no loss scaling
        leaves = jax.tree_util.tree_leaves(state)  # a pytree of arrays: jit, pmap, savez
    """

    weights: PyTree
    """The weights the optimizer updates (see the class docstring)."""
    opt_state: PyTree
    """The optax optimizer's state, as ``tx.init`` made it."""
    loss_scale: ScaleArrays
    """The dynamic loss scale's running fields (a fixed scale never moves)."""
    steps: jax.Array
    """int32: steps taken, skipped ones included."""
    skipped_steps: jax.Array
    """int32: steps skipped because a gradient was inf/NaN or the norm overflowed."""
    compensation: PyTree = None
    """``master=kahan``: the bfloat16 compensation ``c`` per weight (else None)."""
    rng: Any = None
    """``master=stochastic``: the raw data of the rounding's ``jax.random`` key (else None)."""
    model_state: PyTree = None
    """Non-trainable model variables (flax ``batch_stats``) given to ``init``, or None."""


class StepInfo(NamedTuple):
    """What one step reports besides the loss; every field is an array.

    Example::

        import jax.numpy as jnp
        import optax

        import mixprec.jax as mpj

        opt = mpj.Optimizer(optax.sgd(0.1), policy="O2")  # float16, dynamic loss scale
        step = opt.make_step(lambda p, b: jnp.sum(p["w"] * b))
        batch = jnp.full(3, 1e30)  # inf once cast to float16: the gradients overflow
        loss, state, info = step(opt.init({"w": jnp.ones(3)}), batch)
        assert bool(info.skipped) and float(info.loss_scale) == 65536.0
        assert float(state.loss_scale.scale) == 32768.0  # backed off for the next step
    """

    skipped: jax.Array
    """bool: the step was skipped (inf/NaN gradients or an overflowing norm), on every
    device of the axis alike."""
    loss_scale: jax.Array
    """float32: the loss scale this step ran with."""
    grad_norm: jax.Array
    """float32: the global norm of the unscaled gradients (inf/NaN on a skipped step)."""
    floor: jax.Array
    """bool: the loss scale backed off to its ``min`` on this step (the floor warning of
    the other backends)."""
