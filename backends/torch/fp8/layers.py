"""FP8 in the torch backend: which ``nn.Linear`` layers run in FP8, and the delayed state.

At ``wrap`` :func:`plan_fp8` picks, before anything changes, every ``nn.Linear`` (and
subclass) where the policy's ``fp8`` applies (:meth:`mixprec.Policy.fp8_for`: the
``linear`` family decided by the global op lists, in the compute dtype) and no module rule
pins the layer or a module around it, and refuses what cannot run. :meth:`FP8Layers.install`
then gives each the forward of :mod:`mixprec_torch.fp8.linear`. Only those layers run in
FP8: ``F.linear`` called outside an ``nn.Linear`` (attention's fused projections inside
``nn.MultiheadAttention``, functional code) keeps the base policy's dtype.

:class:`FP8Layers` is also the delayed recipe's state for the optimizers of the ``wrap``
call: the core's :class:`~mixprec.fp8_scaling.DelayedScaling` (the amax histories) and, on
each layer's device, this step's scales and recorded amaxes. It is a round guard of the
step (:class:`~mixprec_torch.step.optimizer_state.RoundGuard`): a non-finite recorded amax skips
the step, and after the step's decision the recorded amaxes enter the histories, unless the
step was skipped (one host read of all the amaxes per step). Its state travels in
``optimizer.state_dict()["mixprec"]["fp8"]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mixprec.errors import CheckpointError, UnsupportedDtypeError, WrapError
from mixprec.kit import ROLE_FORMATS, ROLES, DelayedScaling, FP8Recipe, Policy

from ..copies import CopyOnly
from ..devices import device_capability
from ..dtypes import torch_dtype
from ..sites import ModuleSite
from .linear import DelayedTensors, FP8Forward
from .numerics import native_gemms

__all__ = ["FP8Layers", "plan_fp8"]


class FP8Layers(CopyOnly):
    """The FP8 layers of one ``wrap`` call (see the module docstring).

    :param recipe: the policy's recipe.
    :param layers: (qualified name, layer) of every ``nn.Linear`` that runs in FP8.
    :param out_dtype: the policy's compute dtype, the dtype of the layers' outputs.
    :param owners: the index (in the ``wrap`` call) of each layer's model; all 0 by default.
    """

    def __init__(
        self,
        recipe: FP8Recipe,
        layers: Sequence[tuple[str, nn.Linear]],
        out_dtype: str,
        owners: Sequence[int] | None = None,
    ) -> None:
        self.recipe = recipe
        self.names = [name for name, _ in layers]
        self.modules = [module for _, module in layers]
        self.owners = list(owners) if owners is not None else [0] * len(self.modules)
        self.out_dtype = torch_dtype(out_dtype)
        delayed = recipe.name == "delayed"
        self.state: DelayedScaling | None = DelayedScaling.for_recipe(recipe) if delayed else None
        self.forwards: list[FP8Forward] = []

    def install(self) -> None:
        """Give every layer its FP8 forward (before the casting hooks wrap the forwards)."""
        for module in self.modules:
            device = module.weight.device
            native = native_gemms(device.type, device.index).runs(self.recipe.name)
            tensors = DelayedTensors(device) if self.state is not None else None
            forward = FP8Forward(
                module, self.recipe.name, self.out_dtype, native=native, delayed=tensors
            )
            module.forward = forward  # type: ignore[method-assign]
            self.forwards.append(forward)

    # ------------------------------------------------------------------ the step's guard

    def _in_scope(self, scope: frozenset[int]) -> list[int]:
        """The positions of the layers whose model is in ``scope``."""
        return [i for i, owner in enumerate(self.owners) if owner in scope]

    def _recorded(self, picked: Sequence[int]) -> list[torch.Tensor]:
        out = []
        for i in picked:
            delayed = self.forwards[i].delayed
            assert delayed is not None
            out.append(torch.cat((delayed.amax, delayed.amax_grad.reshape(1))))
        return out

    def flag(self, scope: frozenset[int]) -> torch.Tensor | None:
        """Nonzero (on the device, no host sync) when an amax recorded this step by a layer
        of the models in ``scope`` is not finite: the step is skipped, and the amax never
        reaches a history or a scale."""
        picked = self._in_scope(scope)
        if self.state is None or not self.forwards or not picked:
            return None
        recorded = self._recorded(picked)
        device = recorded[0].device
        found = [torch.isfinite(r).all().logical_not().to(device) for r in recorded]
        return torch.stack(found).any().reshape(1).to(torch.float32)

    def settle(self, skipped: bool, scope: frozenset[int]) -> None:
        """After the step's decision for the models in ``scope``: their layers' recorded
        amaxes enter the histories (dropped when ``skipped``), the next step's scales are
        written, their records start over. Layers of other models keep their records for
        their own optimizers' round."""
        picked = self._in_scope(scope)
        if self.state is None or not self.forwards or not picked:
            return
        with torch.no_grad():
            values = [r.tolist() for r in self._recorded(picked)]
            amaxes = {
                f"{self.names[i]}:{role}": value
                for i, row in zip(picked, values, strict=True)
                for role, value in zip(ROLES, row, strict=True)
                if not value < 0  # -1: the tensor did not run this step (NaN is kept)
            }
            self.state = self.state.update(amaxes, skipped).state
            self._write_scales()
            for i in picked:
                delayed = self.forwards[i].delayed
                assert delayed is not None
                delayed.reset()

    def _write_scales(self) -> None:
        assert self.state is not None
        for name, forward in zip(self.names, self.forwards, strict=True):
            assert forward.delayed is not None
            scales = [self.state.scale(f"{name}:{r}", ROLE_FORMATS[r]) or 0.0 for r in ROLES]
            forward.delayed.scales.copy_(torch.tensor(scales, dtype=torch.float32))

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The recipe and (delayed) the amax histories: plain data."""
        out: dict[str, Any] = {"recipe": str(self.recipe)}
        if self.state is not None:
            out["delayed"] = self.state.state_dict()
        return out

    def _loaded(self, sd: Any) -> DelayedScaling | None:
        if not isinstance(sd, dict) or sd.get("recipe") != str(self.recipe):
            raise CheckpointError(
                f"the optimizer state dict's FP8 state is for another recipe ({_short(sd)}); "
                f"this model runs fp8={self.recipe}. Wrap with the saved policy to resume it"
            )
        if self.state is None:
            return None
        state = DelayedScaling.from_state_dict(sd.get("delayed"))
        known = {f"{name}:{role}" for name in self.names for role in ROLES}
        strangers = sorted(set(state.amax_history) - known)
        if strangers or (state.history, state.margin) != (self.state.history, self.state.margin):
            raise CheckpointError(
                f"the saved delayed FP8 state does not fit this model (history "
                f"{state.history}, margin {state.margin}; tensors it does not have: "
                f"{strangers[:4]}); load the checkpoint of this model and policy"
            )
        return state

    def check_state_dict(self, sd: Any) -> None:
        """Refuse a malformed or foreign FP8 state before anything is loaded."""
        self._loaded(sd)

    def load_state_dict(self, sd: Any) -> None:
        """Take the saved histories; the next step uses the scales they give."""
        state = self._loaded(sd)
        if state is not None:
            self.state = state
            self._write_scales()


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _pinned(name: str, pins: set[str]) -> bool:
    """Whether a module rule pins ``name`` or a module around it."""
    if "" in pins:
        return True
    parts = name.split(".")
    return any(".".join(parts[:i]) in pins for i in range(1, len(parts) + 1))


def plan_fp8(
    plans: Sequence[Sequence[ModuleSite]], policy: Policy, *, fsdp: bool
) -> FP8Layers | None:
    """The FP8 layers of the models whose module plans (:func:`~mixprec_torch.sites.plan_model`)
    are ``plans``, under ``policy`` (None without ``fp8``). Changes nothing.

    :raises WrapError: FP8 with FSDP2, or a layer whose ``forward`` was already replaced.
    :raises UnsupportedDtypeError: a layer on a device that runs no FP8.
    """
    recipe = policy.fp8
    if recipe is None:
        return None
    if fsdp:
        raise WrapError(
            f"fp8={recipe} (policy {policy.label}) is not supported with FSDP2 yet: the FP8 "
            "layers would quantise sharded weights. Use the policy without fp8 under FSDP2"
        )
    layers: list[tuple[str, nn.Linear]] = []
    owners: list[int] = []
    seen: set[int] = set()
    for index, sites in enumerate(plans):
        prefix = f"model{index}." if len(plans) > 1 else ""
        pins = {site.name for site in sites if site.pin is not None}
        for site in sites:
            module = site.module
            if not isinstance(module, nn.Linear) or id(module) in seen:
                continue
            if _pinned(site.name, pins) or policy.fp8_for(site.name, site.classes) is None:
                continue
            _check_layer(prefix + site.name, module, recipe)
            seen.add(id(module))
            layers.append((prefix + site.name, module))
            owners.append(index)
    return FP8Layers(recipe, layers, policy.compute, owners)


def _check_layer(name: str, module: nn.Linear, recipe: FP8Recipe) -> None:
    if "forward" in vars(module):
        raise WrapError(
            f"layer {name!r} ({type(module).__name__}) has its forward replaced already, so "
            f"mixprec cannot run it as an FP8 GEMM (fp8={recipe}); keep it out of FP8 with a "
            f"module rule: 'path:{name}=bfloat16' (policy.with_module({name!r}, 'bfloat16', "
            "match='path'))"
        )
    device = module.weight.device
    cap = device_capability(device)
    recipes = () if cap is None else cap.fp8_recipes
    if recipe.name not in recipes:
        raise UnsupportedDtypeError(
            f"layer {name!r} is on {device}, where the torch backend runs no fp8={recipe} "
            f"(it runs: {', '.join(recipes) or 'none'}); move the model to the CPU or a CUDA "
            f"device, or keep the layer out of FP8 with 'path:{name}=bfloat16'"
        )
    if isinstance(module.weight, nn.parameter.UninitializedParameter):
        raise WrapError(
            f"layer {name!r} is lazy and has no weight yet; run one batch through the model "
            "before wrap, so that FP8 can scale its weight"
        )
