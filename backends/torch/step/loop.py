"""The training-loop calls around the step: ``scale_loss``, ``unscale_``, ``master_params``
and ``state``, each taking a wrapped optimizer (the MXNet backend's :mod:`loop` takes a
trainer instead, with the same names). They check their arguments and the order of calls;
the arithmetic is :mod:`mixprec_torch.step.protocol`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from mixprec.errors import StepOrderError, WrapError
from mixprec.kit import MixprecState

from .model_edits import expose_unscaled_grads
from .optimizer_state import OptimizerState, optimizer_state
from .protocol import count_plain_backward, layout, scaled_loss, unscale

__all__ = ["master_params", "scale_loss", "state", "unscale_"]


def _as_list(optimizers: Any) -> list[Any]:
    if optimizers is None:
        return []
    if isinstance(optimizers, (list, tuple)):
        return list(optimizers)
    return [optimizers]


@contextmanager
def scale_loss(loss: torch.Tensor, optimizers: Any) -> Iterator[torch.Tensor]:
    """Yield ``loss`` cast to float32 and multiplied by the loss scale; call ``backward()`` on it.

    ``optimizers`` (one or a list, all from one ``wrap`` call) are the optimizers whose
    parameters this backward pass produces gradients for: they unscale and skip together.
    Several ``scale_loss`` blocks before one ``step()`` accumulate gradients.
    """
    opts = _as_list(optimizers)
    if not opts:
        raise WrapError(
            "scale_loss needs the optimizer(s) whose gradients this loss produces: "
            "scale_loss(loss, optimizer) or scale_loss(loss, [opt_a, opt_b])"
        )
    states = [optimizer_state(opt, "scale_loss") for opt in opts]
    group = states[0].group
    if any(s.group is not group for s in states):
        raise WrapError(
            "scale_loss got optimizers from different wrap calls, which have different loss "
            "scales; wrap every model and optimizer that share a loss in one call: "
            "mixprec.torch.wrap([model_a, model_b], [opt_a, opt_b])"
        )
    if not isinstance(loss, torch.Tensor):
        raise WrapError(f"scale_loss needs the loss as a tensor, got {type(loss).__name__}")
    if any(st.iteration.reevaluating for st in states):
        # inside step(closure), LBFGS re-evaluating: the backward belongs to that step
        yield scaled_loss(loss, group)
        return
    for st in states:
        if st.iteration.round is not None:
            raise StepOrderError(
                "scale_loss: this optimizer's gradients from the previous backward pass were "
                "already unscaled and checked by the step() of another optimizer of the same "
                "wrap call, and its own step() has not run yet; call step() on every "
                "optimizer passed to scale_loss before the next backward pass"
            )
    counted: list[OptimizerState] = []
    try:
        for st in states:
            st.tracker.on_backward()
            counted.append(st)
    except BaseException:
        for st in counted:
            st.tracker.cancel_backward()
        raise
    scaled = scaled_loss(loss, group)
    try:
        yield scaled
    except BaseException:
        for st in counted:
            st.tracker.cancel_backward()
        raise


def unscale_(optimizer: torch.optim.Optimizer) -> None:
    """Divide the optimizer's gradients by the loss scale now (before clipping).

    After it, ``master_params(optimizer)`` hold the true float32 gradients, and the model's
    own gradients hold the same values in the model's dtype: clip either
    (``clip_grad_norm_(model.parameters(), c)`` reaches the masters at the step). Call it
    once per step, after the last backward pass; ``step()`` then does not unscale again.
    """
    st = optimizer_state(optimizer, "unscale_")
    it = st.iteration
    if it.round is not None and it.implicit_unscale:
        it.implicit_unscale = False  # another optimizer's step() already unscaled these
        if st.local is None:  # but left the model's own gradients scaled: the clip is on them
            lay = layout(st, optimizer)
            expose_unscaled_grads(st, lay.params, lay.masters)
        return
    count_plain_backward(st)  # no loss scaling: a plain loss.backward() is enough
    st.tracker.on_unscale()
    unscale(st, optimizer, check=False)  # the step checks, after any clip or edit since
    if st.local is None:  # FSDP2 keeps no separate masters
        lay = layout(st, optimizer)
        expose_unscaled_grads(st, lay.params, lay.masters)


def master_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors the optimizer updates: float32 masters, or the model params themselves.

    Clip these (after ``unscale_``): ``clip_grad_norm_(master_params(opt), max_norm)``.
    Under ``master=kahan|stochastic`` their values are ``w + c`` (or ``w``) from this call
    until the next step (they hold no memory otherwise): call it again after each step to
    read the new values.
    """
    st = optimizer_state(optimizer, "master_params")
    if st.group.compensation is not None:
        st.group.compensation.materialize()
    return [p for group in optimizer.param_groups for p in group["params"]]


def state(optimizer: torch.optim.Optimizer) -> MixprecState:
    """Loss scale, skip counters, resolved policy and events of the optimizer's group, and
    the steps this optimizer skipped alone (a round member whose gradients were written
    after the round's check and overflow): counted in ``skipped_steps``, and
    ``last_step_skipped`` while no step of the group came after, so that the documented
    ``if not state(optimizer).last_step_skipped: scheduler.step()`` holds its schedule."""
    st = optimizer_state(optimizer, "state")
    shared = st.group.scaler.snapshot(st.group.policy)
    if not st.own_skips:
        return shared
    return dataclasses.replace(
        shared,
        skipped_steps=shared.skipped_steps + st.own_skips,
        last_step_skipped=shared.last_step_skipped or st.own_skip_at == shared.steps,
    )
