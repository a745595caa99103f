"""``apex.amp`` on mixprec: change ``from apex import amp`` to
``from mixprec.compat import apex_amp as amp`` and the rest of the code runs unchanged.

What runs underneath: ``initialize`` turns apex's arguments into a :class:`mixprec.Policy`
and calls :func:`mixprec.torch.wrap` (exact float32 masters in ``state_dict()``, bf16,
``explain``, diagnostics). The loss scaling is apex's: one loss scaler per ``loss_id``
(``num_losses``), the gradients are unscaled into the float32 master gradients when
``scale_loss`` exits (unless ``delay_unscale``), and an optimizer skips its next ``step()``
only when a ``scale_loss`` it took part in overflowed; each loss's scaler backs off on its
own. docs/migration.md has the table of every argument and what it maps to.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from mixprec.errors import CheckpointError, MixprecWarning, PolicyError, WrapError
from mixprec.kit import (
    DynamicScale,
    LossScaler,
    NoScale,
    Policy,
    Stage,
    format_loss_scale,
    is_low_precision,
)

from ..dtypes import dtype_name, torch_dtype
from ..step.distributed import is_distributed
from ..step.optimizer_state import OptimizerState, optimizer_state
from ..step.protocol import copies, reduce_found_inf, unscale
from ..wrapping.wrap import wrap
from .apex_functions import (
    apply_registered,
    disable_casts,
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from .apex_policy import apex_loss_scale, apex_policy

__all__ = [
    "disable_casts",
    "float_function",
    "half_function",
    "initialize",
    "load_state_dict",
    "loss_scalers",
    "master_params",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "scale_loss",
    "state_dict",
]


@dataclasses.dataclass
class _Amp:
    enabled: bool = False
    policy: Policy | None = None
    scalers: list[LossScaler] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _OptAmp:
    scaled: bool = False
    """Model gradients are still scaled (a ``delay_unscale`` exit): no stash at the next entry."""
    overflowed: bool = False
    """A ``scale_loss`` this optimizer took part in overflowed since its last step."""


_AMP = _Amp()
_OPTS: weakref.WeakKeyDictionary[Any, _OptAmp] = weakref.WeakKeyDictionary()


# ------------------------------------------------------------------ initialize


def _inner(optimizer: Any) -> Any:
    """The torch optimizer inside a wrapper such as apex's LARC (``.optim``) or a
    Lookahead (``.optimizer``); the optimizer itself otherwise."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    for name in ("optim", "optimizer"):
        inner = getattr(optimizer, name, None)
        if isinstance(inner, torch.optim.Optimizer):
            return inner
    return optimizer  # not an optimizer: wrap raises its WrapError naming the fix


def _low_weights(models: Any, policy: Policy, keep: bool) -> bool:
    """Whether some weights will be low precision: the policy's ``param``, or, when each
    parameter keeps its own dtype, any low-precision parameter of the models."""
    if not keep:
        return is_low_precision(policy.param)
    listed = models if isinstance(models, (list, tuple)) else [models]
    return any(
        is_low_precision(dtype_name(p.dtype))
        for m in listed
        if isinstance(m, torch.nn.Module)
        for p in m.parameters()
        if p.is_floating_point()
    )


def initialize(
    models: Any,
    optimizers: Any = None,
    enabled: bool = True,
    opt_level: Any = "O1",
    cast_model_type: Any = None,
    patch_torch_functions: Any = None,
    keep_batchnorm_fp32: Any = None,
    master_weights: Any = None,
    loss_scale: Any = None,
    cast_model_outputs: Any = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
) -> Any:
    """apex's ``amp.initialize``: returns ``models`` (a model or list) when ``optimizers`` is
    None, else ``(models, optimizers)`` in the shapes given.

    ``opt_level`` is apex's ``"O0"``-``"O3"`` (mixprec's presets of the same names) or any
    mixprec policy (``"O2-bf16"``); the other arguments override it as in apex.
    """
    if isinstance(num_losses, bool) or not isinstance(num_losses, int) or num_losses < 1:
        raise PolicyError(f"num_losses must be an integer >= 1, got {num_losses!r}")
    if not enabled:
        _AMP.enabled, _AMP.policy, _AMP.scalers = False, None, []
        return models if optimizers is None else (models, optimizers)
    policy = apex_policy(
        opt_level,
        cast_model_type,
        patch_torch_functions,
        keep_batchnorm_fp32,
        master_weights,
        cast_model_outputs,
    )
    scale = apex_loss_scale(policy, loss_scale, min_loss_scale, max_loss_scale)
    policy = apply_registered(policy, torch_dtype(policy.compute))
    keep = cast_model_type is False  # apex: the model is not cast at all
    if scale.enabled and not policy.uses_masters and _low_weights(models, policy, keep):
        warnings.warn(
            f"loss scaling ({scale!r}) without float32 master weights: the optimizer updates "
            "low-precision weights directly (apex O3 with a loss scale), so small updates "
            "round away. mixprec.torch.wrap refuses this; the apex shim accepts it as apex "
            "did. Prefer opt_level='O2' (masters) or a bf16 policy",
            MixprecWarning,
            stacklevel=2,
        )
    listed = isinstance(optimizers, (list, tuple))
    opts = [_inner(o) for o in (optimizers if listed else [optimizers])]
    if optimizers is None:
        opts = []
    # The shim scales each loss itself (one scaler per loss_id), so the group scales nothing.
    no_scale = dataclasses.replace(policy, loss_scale=NoScale())
    result = wrap(
        models,
        opts if listed else (opts[0] if opts else None),
        policy=no_scale,
        keep_dtypes=keep,
    )
    for opt in opts:  # wrapped in place: wrappers such as LARC now hold a wrapped optimizer
        st = optimizer_state(opt)
        st.group.skip_each = True  # apex: only overflowing optimizers skip
        # apex: every step, taken or skipped, clears the float32 master gradients, which a
        # user's model.zero_grad() cannot reach (their losses accumulate there until the step)
        st.drop_master_grads = True
        _OPTS[opt] = _OptAmp()
    _AMP.enabled, _AMP.policy = True, policy
    _AMP.scalers = [LossScaler(scale) for _ in range(num_losses)]
    if verbosity:
        shown = format_loss_scale(scale)
        print(f"mixprec apex_amp: opt_level {opt_level!r} runs as {policy}, loss scale {shown}")
    return result if optimizers is None else (result[0], optimizers)


# ------------------------------------------------------------------ scale_loss


def _opt_list(optimizers: Any) -> list[Any]:
    opts = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    if not opts or any(o is None for o in opts):
        raise WrapError("scale_loss needs the optimizer(s) that initialize returned")
    return [_inner(o) for o in opts]


def _stash(st: OptimizerState, opt: Any) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Take the gradients the optimizer already holds (unscaled, from an earlier loss of
    this step) out of the way, so the next backward starts from None. The low-precision
    model gradients are dropped (apex's ``prepare_backward``): what they hold came from a
    backward pass of another optimizer's loss (a GAN's generator loss runs through the
    discriminator), never from this optimizer's, which its last ``scale_loss`` consumed."""
    for model_param in copies(st, opt)[0]:
        model_param.grad = None
    saved = []
    for group in opt.param_groups:
        for param in group["params"]:
            saved.append((param, param.grad))
            param.grad = None
    return saved


def _add_back(saved: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
    for param, grad in saved:
        if grad is None:
            continue
        if param.grad is None:
            param.grad = grad
        else:
            param.grad.add_(grad)


def _enter(st: OptimizerState, info: _OptAmp) -> None:
    tracker = st.tracker
    if tracker.stage is Stage.UNSCALED:
        # unscaled at our last exit and stashed below: a next loss may accumulate (apex)
        tracker.stage = Stage.READY
    elif tracker.stage is Stage.READY and tracker.backwards == 0:
        info.overflowed = False  # the first backward since the last step
    tracker.on_backward()


def _exit(
    opts: list[Any], states: list[OptimizerState], scaler: LossScaler, stashes: list[Any]
) -> None:
    flags: list[torch.Tensor] = []
    for st, opt in zip(states, opts, strict=True):
        # model grads -> float32 master grads, / scale; the loss's scaler hears of an inf or
        # NaN now (apex), the guard's norm check runs at the step, after any clip or edit
        unscale(st, opt, scale=scaler.scale, check=False)
        flags.extend(st.iteration.found_inf)
    found = reduce_found_inf(flags, states[0].group.device)
    scaler.update(found, rank=torch.distributed.get_rank() if found and is_distributed() else None)
    for st, opt, saved in zip(states, opts, stashes, strict=True):
        if saved is not None:
            _add_back(saved)
        for model_param in copies(st, opt)[0]:
            model_param.grad = None  # consumed into the master: the next loss starts clean
        info = _OPTS.setdefault(opt, _OptAmp())
        info.scaled = False
        info.overflowed = info.overflowed or found
        found_inf = st.iteration.found_inf
        device = found_inf[0].device if found_inf else torch.device(st.group.device)
        st.iteration.found_inf = [torch.full((1,), float(info.overflowed), device=device)]
        if st.tracker.stage is Stage.READY:
            st.tracker.on_unscale()


@contextmanager
def scale_loss(
    loss: torch.Tensor,
    optimizers: Any,
    loss_id: int = 0,
    model: Any = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> Iterator[torch.Tensor]:
    """Yield ``loss.float() * scale`` of loss ``loss_id``'s scaler; call ``backward()`` on it.

    On exit the gradients are unscaled into the optimizers' float32 master gradients and
    added to what an earlier loss left there; on an overflow that loss's scaler backs off and
    every optimizer passed here skips its next ``step()``. ``delay_unscale=True`` keeps the
    gradients scaled for a later ``scale_loss`` of the same step (same ``loss_id``).
    ``model`` is accepted and ignored, as apex's amp did. ``delay_overflow_check`` is
    accepted and ignored: apex then skipped the overflow check (an inf gradient went into
    the step); the shim always checks (docs/migration.md says why).
    """
    del model, delay_overflow_check
    if not _AMP.enabled:
        yield loss
        return
    if not 0 <= loss_id < len(_AMP.scalers):
        raise PolicyError(
            f"loss_id={loss_id!r} but initialize was called with num_losses="
            f"{len(_AMP.scalers)}; pass num_losses=<number of losses> to amp.initialize"
        )
    opts = _opt_list(optimizers)
    states = [optimizer_state(opt, "amp.scale_loss") for opt in opts]
    scaler = _AMP.scalers[loss_id]
    stashes = []
    for st, opt in zip(states, opts, strict=True):
        info = _OPTS.setdefault(opt, _OptAmp())
        _enter(st, info)
        stashes.append(None if info.scaled else _stash(st, opt))
    scaled = loss.float() * scaler.scale if scaler.enabled else loss.float()
    try:
        yield scaled
    except BaseException:
        for st, saved in zip(states, stashes, strict=True):
            st.tracker.cancel_backward()
            for param, grad in saved or ():
                param.grad = grad
        raise
    if delay_unscale:
        for opt in opts:
            _OPTS[opt].scaled = True
        return
    _exit(opts, states, scaler, stashes)


# ------------------------------------------------------------------ the rest of amp


def master_params(optimizer: Any) -> Iterator[torch.Tensor]:
    """The tensors the optimizer updates (float32 masters where kept): clip these."""
    optimizer = _inner(optimizer)
    optimizer_state(optimizer, "amp.master_params")
    for group in optimizer.param_groups:
        yield from group["params"]


def loss_scalers() -> list[LossScaler]:
    """mixprec's addition: the loss scalers, one per ``loss_id`` (scale, skips, events)."""
    return list(_AMP.scalers)


def state_dict(destination: dict[str, Any] | None = None) -> dict[str, Any]:
    """apex's format, one ``"loss_scaler<i>"`` entry per loss (``loss_scale``,
    ``unskipped``), each with mixprec's exact scaler state under ``"mixprec"``."""
    out: dict[str, Any] = {} if destination is None else destination
    for i, scaler in enumerate(_AMP.scalers):
        out[f"loss_scaler{i}"] = {
            "loss_scale": scaler.scale,
            "unskipped": getattr(scaler.state, "good_steps", 0),
            "mixprec": scaler.state_dict(),
        }
    return out


def load_state_dict(state: Mapping[str, Any]) -> None:
    """Restore :func:`state_dict`'s output, or a checkpoint apex's own amp saved."""
    if len(state) != len(_AMP.scalers) or any(
        f"loss_scaler{i}" not in state for i in range(len(_AMP.scalers))
    ):
        raise CheckpointError(
            f"amp state has entries {sorted(state)} but initialize made {len(_AMP.scalers)} "
            "loss scaler(s); call amp.initialize with the num_losses it was saved with first"
        )
    loaded = []
    for i, scaler in enumerate(_AMP.scalers):
        entry = state[f"loss_scaler{i}"]
        if not isinstance(entry, Mapping):
            raise CheckpointError(
                f"amp state entry 'loss_scaler{i}' is a {type(entry).__name__}, not a dict; "
                "pass what amp.state_dict() returned"
            )
        if "mixprec" in entry:
            fresh = LossScaler(scaler.state)
            fresh.load_state_dict(entry["mixprec"])
            loaded.append(fresh.state_dict())
        elif isinstance(scaler.state, DynamicScale):  # saved by apex itself
            loaded.append(_from_apex(scaler, entry, i))
        else:
            loaded.append(scaler.state_dict())
    for scaler, saved in zip(_AMP.scalers, loaded, strict=True):  # all checked: now change
        scaler.load_state_dict(saved)


def _from_apex(scaler: LossScaler, entry: Mapping[str, Any], i: int) -> dict[str, Any]:
    """The scaler state for an entry apex's own amp saved (``loss_scale``, ``unskipped``),
    checked whole: a missing, non-finite or negative value raises CheckpointError."""
    state = scaler.state
    assert isinstance(state, DynamicScale)
    try:
        unskipped = entry["unskipped"]
        if isinstance(unskipped, bool) or int(unskipped) != unskipped or unskipped < 0:
            raise ValueError(f"unskipped={unskipped!r} is not a non-negative whole number")
        moved = dataclasses.replace(
            state, scale=entry["loss_scale"], good_steps=int(unskipped) % state.interval
        )
    except (KeyError, TypeError, ValueError, OverflowError) as err:
        raise CheckpointError(
            f"amp state entry 'loss_scaler{i}' is malformed ({err}); it needs 'loss_scale' "
            "(a positive finite number) and 'unskipped' (a step count), as apex saved them"
        ) from err
    return {**scaler.state_dict(), "loss_scale": moved.state_dict()}
