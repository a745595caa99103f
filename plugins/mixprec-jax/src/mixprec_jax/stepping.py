"""One step, as a pure function: the step protocol of every mixprec backend, traced.

Scale the loss -> backward -> (several devices: reduce the gradients and the overflow flag
across the axis) -> unscale into float32 and check for inf/NaN and an overflowing squared
norm -> let optax update the float32 working values (a low-bit optimizer state decoded
around its update: :mod:`mixprec_jax.lowbit`), or keep everything as it was ->
update the loss scale with the core's state machine (:func:`mixprec.traced_scale.next_scale`)
-> store the weights back (masters as they are; compensated ones rounded).

Nothing here branches on a value: a skipped step selects the old state leaf by leaf with
``jnp.where``, so the step compiles once and runs under ``jit``, ``pmap`` and
``shard_map`` alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax

from mixprec.errors import WrapError
from mixprec.kit import Policy, ScaleState, next_scale
from mixprec_jax import compensation, lowbit
from mixprec_jax.casting import PyTree, cast, cast_floating, dtype_name, is_floating, to_float32
from mixprec_jax.intercept import policy_scope
from mixprec_jax.state import ScaleArrays, State, StepInfo
from mixprec_jax.trees import Modules, has_class_pins, leaf_names, param_dtypes


class Optimizer(Protocol):
    """What a step needs of :class:`mixprec_jax.Optimizer` (which calls into this module, so
    it is typed here structurally rather than imported: no import circle)."""

    policy: Policy
    tx: optax.GradientTransformation
    modules: Modules | None
    seen_modules: Modules | None

    def check_stored_dtypes(self, state: State, dtypes: list[str], modules: Modules | None) -> None:
        """Refuse a state whose stored dtypes do not match the policy's."""


__all__ = ["LossFn", "build_step", "forward_params", "working_values"]

LossFn = Callable[..., Any]
"""``loss_fn(params, batch) -> loss``, or with ``model_state`` in the state
``loss_fn(params, batch, model_state) -> (loss, new_model_state)``."""


def _call(loss_fn: LossFn, params: PyTree, batch: PyTree, model_state: PyTree) -> Any:
    if model_state is None:
        return loss_fn(params, batch), None
    out = loss_fn(params, batch, model_state)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise WrapError(
            "the state holds model_state, so loss_fn(params, batch, model_state) must return "
            f"(loss, new_model_state); it returned {type(out).__name__}"
        )
    return out


def discover_modules(opt: Optimizer, loss_fn: LossFn, state: State, batch: PyTree) -> Modules:
    """The flax modules ``loss_fn`` calls (path -> classes), by tracing it abstractly once
    under the policy's scope (needed only when a class rule pins a dtype)."""
    found: dict[str, tuple[str, ...]] = {}

    def run(params: PyTree, batch: PyTree, model_state: PyTree) -> Any:
        with policy_scope(opt.policy) as scope:
            out = _call(loss_fn, params, batch, model_state)
        found.update({path: seen.classes for path, seen in scope.modules.items()})
        return out

    def shape(x: Any, dtype: Any = None) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, dtype or x.dtype)

    shapes = (
        jax.tree_util.tree_map(lambda x: shape(x, jnp.float32), state.weights),
        jax.tree_util.tree_map(shape, (batch, state.model_state)),
    )
    jax.eval_shape(run, shapes[0], *shapes[1])
    return found


def forward_params(opt: Optimizer, state: State, dtypes: list[str]) -> PyTree:
    """The parameters the forward pass reads: each weight in the dtype the policy gives it."""
    leaves, treedef = jax.tree_util.tree_flatten(state.weights)
    return treedef.unflatten([cast(w, d) for w, d in zip(leaves, dtypes, strict=True)])


def working_values(opt: Optimizer, state: State) -> PyTree:
    """The values optax updates: float32 masters, ``w + c`` (kahan), float32 ``w``
    (stochastic), or the parameters as they are (no master)."""
    strategy = opt.policy.master_strategy
    if strategy is not None:
        return compensation.working_values(strategy, state.weights, state.compensation)
    return state.weights


def _sum_of_squares(grads: PyTree) -> jax.Array:
    total = jnp.float32(0.0)
    for g in jax.tree_util.tree_leaves(grads):
        total = total + jnp.sum(jnp.square(g.astype(jnp.float32)), dtype=jnp.float32)
    return total


def _select(skipped: jax.Array, old: PyTree, new: PyTree) -> PyTree:
    return jax.tree_util.tree_map(lambda o, n: jnp.where(skipped, o, n), old, new)


def build_step(
    opt: Optimizer, loss_fn: LossFn, axis_name: str | None
) -> Callable[[State, PyTree], tuple[jax.Array, State, StepInfo]]:
    """The step function (not yet jitted) of :meth:`mixprec_jax.Optimizer.make_step`."""
    policy, tx = opt.policy, opt.tx
    scale_config = policy.loss_scale

    def step(state: State, batch: PyTree) -> tuple[jax.Array, State, StepInfo]:
        modules = opt.modules
        if modules is None and has_class_pins(policy):
            modules = discover_modules(opt, loss_fn, state, batch)
        dtypes = param_dtypes(policy, state.weights, modules)
        opt.check_stored_dtypes(state, dtypes, modules)
        params = forward_params(opt, state, dtypes)
        batch = cast_floating(batch, policy.compute)
        scale = state.loss_scale.scale

        def scaled_loss(params: PyTree) -> tuple[jax.Array, tuple[jax.Array, PyTree]]:
            with policy_scope(policy) as scope:
                loss, model_state = _call(loss_fn, params, batch, state.model_state)
            opt.seen_modules = {path: seen.classes for path, seen in scope.modules.items()}
            loss = jnp.asarray(loss).astype(jnp.float32)
            scaled = loss * scale if scale_config.enabled else loss
            return scaled, (loss, model_state)

        (_, (loss, model_state)), grads = jax.value_and_grad(scaled_loss, has_aux=True)(params)
        grads = to_float32(grads)
        local_bad = jnp.asarray(False)
        if axis_name is not None:
            # each device checks its own gradients too: the average may hide an overflow
            local_bad = jnp.logical_not(jnp.isfinite(_sum_of_squares(grads)))
            # the gradients travel in the policy's reduce dtype, still scaled
            grads = to_float32(
                jax.lax.pmean(cast_floating(grads, policy.reduce), axis_name=axis_name)
            )
            loss = jax.lax.pmean(loss, axis_name=axis_name)
            if model_state is not None:
                model_state = jax.tree_util.tree_map(
                    lambda x: jax.lax.pmean(x, axis_name) if is_floating(x) else x, model_state
                )
        if scale_config.enabled:
            inverse = jnp.float32(1.0) / scale
            grads = jax.tree_util.tree_map(lambda g: g * inverse, grads)
        squared = _sum_of_squares(grads)
        skipped = jnp.logical_or(local_bad, jnp.logical_not(jnp.isfinite(squared)))
        if axis_name is not None:  # one overflowing device skips the step on all of them
            skipped = jax.lax.pmax(skipped.astype(jnp.int32), axis_name=axis_name) > 0

        working = working_values(opt, state)
        grads = jax.tree_util.tree_map(lambda g, w: g.astype(w.dtype), grads, working)
        updates, opt_state = tx.update(grads, state.opt_state, working)
        # a low-bit state cannot hold an inf or NaN moment: such an update is skipped (a
        # constant True, so nothing, without one)
        skipped = jnp.logical_or(skipped, jnp.logical_not(lowbit.all_finite(opt_state)))
        updated = optax.apply_updates(working, updates)
        strategy = policy.master_strategy
        comp, rng = state.compensation, state.rng
        if strategy is not None:
            weights, comp, rng = compensation.store(strategy, state.weights, updated, rng)
        else:
            weights = updated

        moved = next_scale(
            scale_config,
            ScaleState(*state.loss_scale),
            skipped,
            jnp.where,
        )
        new_state = State(
            weights=_select(skipped, state.weights, weights),
            opt_state=_select(skipped, state.opt_state, opt_state),
            loss_scale=ScaleArrays(
                jnp.asarray(moved.state.scale, jnp.float32),
                jnp.asarray(moved.state.good_steps, jnp.int32),
                jnp.asarray(moved.state.overflows_left, jnp.int32),
            ),
            steps=state.steps + 1,
            skipped_steps=state.skipped_steps + skipped.astype(jnp.int32),
            compensation=_select(skipped, state.compensation, comp),
            rng=_select(skipped, state.rng, rng),
            model_state=_select(skipped, state.model_state, model_state),
        )
        info = StepInfo(
            skipped=skipped,
            loss_scale=scale,
            grad_norm=jnp.sqrt(squared),
            floor=jnp.asarray(moved.floor, bool),
        )
        return loss, new_state, info

    return step


def stored_dtype_problems(state: State, dtypes: list[str]) -> list[str]:
    """Leaves whose stored dtype is not the one the policy gives them (names and dtypes)."""
    names = leaf_names(state.weights)
    leaves = jax.tree_util.tree_leaves(state.weights)
    return [
        f"{n}: stored {dtype_name(w)}, the policy says {d}"
        for n, w, d in zip(names, leaves, dtypes, strict=True)
        if dtype_name(w) != d
    ]
