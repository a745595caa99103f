"""apex.amp's ``initialize`` arguments as a mixprec policy and loss scale.

docs/migration.md has the table this module implements, argument by argument.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from mixprec.errors import PolicyError
from mixprec.kit import (
    DynamicScale,
    LossScaleConfig,
    NoScale,
    Policy,
    StaticScale,
    get_policy,
    is_low_precision,
)

from ..dtypes import dtype_name

__all__ = ["apex_loss_scale", "apex_policy"]

_NO_FLOOR = 2.0**-24  # apex's min_loss_scale=None: no floor; mixprec's min must be > 0


def _flag(name: str, value: object) -> bool | None:
    """apex accepts ``"True"``/``"False"`` strings for its booleans (its argparse habit)."""
    if value is None or isinstance(value, bool):
        return value
    if value in ("True", "False"):
        return value == "True"
    raise PolicyError(f"{name} must be True, False or None, got {value!r}")


def apex_loss_scale(
    base: Policy, loss_scale: Any, min_scale: float | None, max_scale: float
) -> LossScaleConfig:
    """apex's ``loss_scale``, ``min_loss_scale`` and ``max_loss_scale`` as a mixprec loss
    scale (``None``: the policy's own, with apex's floor and ceiling when it is dynamic)."""
    if loss_scale is None:
        config = base.loss_scale
    elif loss_scale == "dynamic":
        config = DynamicScale()
    elif isinstance(loss_scale, (NoScale, StaticScale, DynamicScale)):
        return loss_scale.fresh()
    else:
        number = _static_scale(loss_scale)
        return NoScale() if number == 1.0 else StaticScale(number)
    if not isinstance(config, DynamicScale):
        return config
    low = _NO_FLOOR if min_scale is None else float(min_scale)
    high = float(max_scale)
    init = min(max(config.init, low), high)
    return dataclasses.replace(config, init=init, scale=init, min=low, max=high)


def _static_scale(value: object) -> float:
    """apex's ``float(loss_scale)``: a number, or a string of one (its examples pass
    ``args.loss_scale`` straight from argparse); positive and finite."""
    number = math.nan
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            number = float(value)
        except (ValueError, OverflowError):
            pass
    if not (math.isfinite(number) and number > 0):
        raise PolicyError(
            f"loss_scale must be None, 'dynamic', a positive finite number (or a string of "
            f"one, such as '128.0') or a mixprec loss scale, got {value!r}"
        )
    return number


def apex_policy(
    opt_level: Any,
    cast_model_type: Any,
    patch_torch_functions: Any,
    keep_batchnorm_fp32: Any,
    master_weights: Any,
    cast_model_outputs: Any,
) -> Policy:
    """The mixprec policy for apex's ``opt_level`` and the arguments that override it.

    ``cast_model_type=False`` leaves ``param`` as the level has it: ``initialize`` wraps with
    ``keep_dtypes=True``, so each parameter keeps its own dtype and ``param`` casts nothing
    (the level's ``master`` still gives the low-precision parameters masters).
    """
    base = get_policy(opt_level)  # a mixprec name ("O2-bf16") or apex's O0-O3 presets
    overrides: dict[str, Any] = {}
    keep = cast_model_type is False
    if cast_model_type is not None and not keep:
        overrides["param"] = overrides["compute"] = dtype_name(cast_model_type)
    patch = _flag("patch_torch_functions", patch_torch_functions)
    if patch is True and not keep and is_low_precision(overrides.get("param", base.param)):
        raise PolicyError(
            "patch_torch_functions=True together with low-precision weights (apex O2 + O1 "
            "patching) is not reproduced; use opt_level='O1' for op-level casting or 'O2' "
            "for low-precision weights"
        )
    if patch is False and base.casts_ops:
        overrides["compute"] = "float32"  # O1 without patching casts nothing
    master = _flag("master_weights", master_weights)
    if master is not None:
        overrides["master"] = "float32" if master else None
    if cast_model_outputs is not None:
        overrides["output"] = dtype_name(cast_model_outputs)
    policy = get_policy(base, **overrides) if overrides else base
    keep_bn = _flag("keep_batchnorm_fp32", keep_batchnorm_fp32)
    if keep_bn is True:
        policy = policy.with_module("*BatchNorm*", "float32")
    elif keep_bn is False:
        kept = tuple(r for r in policy.modules if r.pattern != "*BatchNorm*")
        policy = dataclasses.replace(policy, modules=kept, name=None)
    return policy
