"""Checks every backend runs at wrap time: settings that work but train badly or not at all.

The functions take plain values (names, dtypes, numbers) rather than framework objects, so
both backends and third-party plugins can call them; :func:`check_scaler_without_masters`
also accepts a :class:`~mixprec.policy.value.Policy` but never imports it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from mixprec.dtypes import canonical_dtype, format_info
from mixprec.errors import WrapError

__all__ = ["adam_eps_underflows", "check_adam_eps", "check_scaler_without_masters"]

_MAX_NAMES = 8


def adam_eps_underflows(eps: float, dtype: str, *, squared: bool = False) -> bool:
    """Whether Adam's ``eps`` is lost in ``dtype``.

    True when ``eps`` (``eps**2`` with ``squared=True``, for optimizers that add it under
    the square root) rounds to zero in ``dtype`` or lies below its smallest subnormal, where
    it keeps hardly any precision. Example: 1e-8 underflows in float16 (smallest subnormal
    about 6e-8) but not in bfloat16 or float32.
    """
    value = abs(eps * eps if squared else eps)
    return value < format_info(dtype).smallest_subnormal


def _safe_eps(dtype: str) -> float:
    # The smallest power of ten that is a normal number of the format: 1e-4 for float16.
    return 10.0 ** math.ceil(math.log10(format_info(dtype).smallest_normal))


def check_adam_eps(optimizer_name: str, eps: float, state_dtype: str) -> str | None:
    """Warning text when ``eps`` underflows in the optimizer-state dtype, else None.

    :param optimizer_name: shown in the message (``"Adam"``, ``"torch.optim.AdamW"``).
    :param eps: the optimizer's epsilon.
    :param state_dtype: dtype the optimizer's update is computed in (the master dtype, or
        the parameter dtype when there are no master weights).
    """
    if not adam_eps_underflows(eps, state_dtype):
        return None
    dtype = canonical_dtype(state_dtype)
    info = format_info(dtype)
    if abs(eps) <= info.smallest_subnormal / 2:
        lost = f"underflows to 0 in {dtype}"
    else:
        lost = f"is below {dtype}'s smallest subnormal and keeps almost no precision"
    return (
        f"{optimizer_name}: eps={eps:g} {lost} (the smallest positive {dtype} value is "
        f"{info.smallest_subnormal:.3g}), so weights whose gradient is zero get "
        f"m / (sqrt(v) + eps) = 0/0 = NaN updates. Fix: keep float32 master weights and "
        f"optimizer state (policy 'O2', or master='float32'), or use eps >= "
        f"{_safe_eps(dtype):g}, a value representable in {dtype}."
    )


class _HasLossScale(Protocol):
    @property
    def enabled(self) -> bool: ...


class _PolicyLike(Protocol):
    @property
    def loss_scale(self) -> _HasLossScale: ...


def check_scaler_without_masters(
    policy: bool | _PolicyLike, lowp_param_names: Sequence[str]
) -> None:
    """Refuse loss scaling when low-precision parameters would be updated without masters.

    :param policy: the :class:`~mixprec.policy.value.Policy` (its ``loss_scale.enabled`` is
        read) or simply whether loss scaling is enabled; a plain bool keeps this module
        free of a ``mixprec.policy.value`` import.
    :param lowp_param_names: names of the float16/bfloat16 parameters the optimizer would
        update directly, without a float32 master copy.
    :raises WrapError: loss scaling is on and that list is not empty; the message lists
        the parameters (the first few of a long list) and the fix.
    """
    enabled = policy if isinstance(policy, bool) else policy.loss_scale.enabled
    if not enabled or not lowp_param_names:
        return
    names = ", ".join(lowp_param_names[:_MAX_NAMES])
    if len(lowp_param_names) > _MAX_NAMES:
        names += f", ... and {len(lowp_param_names) - _MAX_NAMES} more"
    raise WrapError(
        f"loss scaling is enabled but {len(lowp_param_names)} low-precision parameter(s) "
        f"have no float32 master copy: {names}. The optimizer would update them in low "
        "precision, where small updates round away and unscaled gradients can overflow. "
        "Fix: use policy 'O2' (float32 master weights) or set master='float32', or disable "
        "loss scaling (loss_scale='none', as in 'O3')."
    )
