"""The dtypes of a wrapped model's parameters: what the plan gives each, casting them in place
at wrap time, and the one-parameter sentinel that catches ``model.float()`` after wrap.

:mod:`mixprec_torch.wrapping.casting` owns the forward hooks; this module only reads the plan
(:func:`mixprec_torch.sites.plan_model`) and changes parameter dtypes.
"""

from __future__ import annotations

from typing import NoReturn

import torch
from torch import nn

from mixprec.errors import WrapError
from mixprec.kit import Policy, is_low_precision

from ..dtypes import FLOATING, torch_dtype
from ..sites import ModuleSite

__all__ = ["apply_param_dtypes", "lowp_param", "planned_dtypes", "recast_error"]


def planned_dtypes(sites: list[ModuleSite]) -> dict[int, str]:
    """id(param) -> the dtype the plan gives it (every floating parameter)."""
    return {
        id(p): site.dtype
        for site in sites
        for p in site.module.parameters(recurse=False)
        if p.is_floating_point()
    }


def apply_param_dtypes(sites: list[ModuleSite]) -> None:
    """Cast each module's own parameters (and their grads) and floating buffers in place
    (``param.data = ...``: the ``Parameter`` objects optimizers and tied modules hold stay)."""
    with torch.no_grad():
        for site in sites:
            dtype = torch_dtype(site.dtype)
            module = site.module
            for param in module.parameters(recurse=False):
                if param.dtype in FLOATING and param.dtype != dtype:
                    param.data = param.data.to(dtype)
                    if param.grad is not None:
                        param.grad = param.grad.to(dtype)
            for bname, buf in list(module.named_buffers(recurse=False, remove_duplicate=False)):
                if buf.dtype in FLOATING and buf.dtype != dtype:
                    setattr(module, bname, buf.to(dtype))  # replaces the registered buffer


def lowp_param(
    model: nn.Module, sites: list[ModuleSite]
) -> tuple[str, nn.Parameter, torch.dtype] | None:
    """One parameter the plan casts to low precision: its dtype is checked on every forward
    (one attribute read) to catch ``model.float()`` and the like after wrap."""
    names = {id(p): n for n, p in model.named_parameters()}
    for site in sites:
        if not is_low_precision(site.dtype):
            continue
        for param in site.module.parameters(recurse=False):
            if param.is_floating_point() and id(param) in names:
                return names[id(param)], param, torch_dtype(site.dtype)
    return None


def recast_error(policy: Policy, name: str, param: nn.Parameter, planned: torch.dtype) -> NoReturn:
    """Raise the error for a wrapped model whose parameters were cast after ``wrap``."""
    raise WrapError(
        f"the wrapped model's parameters were cast after mixprec.torch.wrap: {name!r} is "
        f"{str(param.dtype).removeprefix('torch.')} but policy {policy.label} keeps it "
        f"{str(planned).removeprefix('torch.')} (model.float(), .half(), .bfloat16() or "
        ".to(dtype) change dtypes behind the optimizer's float32 masters). Do not cast a "
        "wrapped model: wrap it with policy='O0' to train in float32, or load "
        "model.state_dict() (float32 values) into an unwrapped copy to evaluate in float32"
    )
