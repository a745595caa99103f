"""FP8 what-if statistics for a PyTorch model: every recipe's error on the same tensors.

``with mixprec.torch.fp8_statistics(model) as stats:`` watches every ``nn.Linear`` of
``model`` (wrapped under any policy, or not wrapped at all) while the block runs: each
call's input, weight and output gradient are quantised under every FP8 recipe as the FP8
layers would (:mod:`mixprec_torch.fp8.numerics`: the input and the weight along the input
features, the output gradient along the output features) and the error recorded in a
:class:`mixprec.fp8_stats.FP8Statistics`. ``delayed`` is simulated with one
:class:`~mixprec.fp8_scaling.DelayedScaling` history per tensor, updated after each call.
The model's own numbers are untouched: the statistics read copies.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.errors import WrapError
from mixprec.kit import (
    FP8_RECIPES,
    ROLE_FORMATS,
    DelayedScaling,
    FP8Recipe,
    FP8Statistics,
    format_info,
)

from .numerics import dequantise, quantise

__all__ = ["fp8_statistics"]


# |x * s| from which the format's largest value is a clip, not a rounding: half a step above
# it (464 for e4m3, whose values end 416, 448; 61440 for e5m2)
_CLIPPED = {
    fmt: info.max + 2.0 ** (math.frexp(info.max)[1] - 2 - info.mantissa_bits)
    for fmt, info in ((f, format_info(f)) for f in set(ROLE_FORMATS.values()))
}


def _errors(x: torch.Tensor, fmt: str, recipe: str, scale: float | None) -> dict[str, Any]:
    """What quantising ``x`` (2-D, reduced along dim 1) under ``recipe`` did, as sums."""
    given = None if scale is None else torch.tensor(scale, device=x.device)
    q = quantise(x, fmt, recipe, 1, given)
    deq = dequantise(q)
    energy = x.square().sum(dim=1)
    lost = (deq - x).square().sum(dim=1)
    usable = torch.isfinite(energy) & torch.isfinite(lost) & (energy > 0)
    per_row = torch.where(usable, lost / torch.where(usable, energy, 1.0), 0.0)
    nonzero = x != 0
    counts = torch.stack(
        (
            per_row.sum(),
            usable.sum(),
            nonzero.sum(),
            (nonzero & (q.q.float() == 0)).sum(),
            ((x * q.scale).abs() >= _CLIPPED[fmt]).sum(),
        )
    ).tolist()
    return {
        "rel_mse_sum": float(counts[0]),
        "rows": int(counts[1]),
        "nonzero": int(counts[2]),
        "flushed": int(counts[3]),
        "saturated": int(counts[4]),
        "elements": x.numel(),
    }


class _Collector:
    """The hooks of one :func:`fp8_statistics` block."""

    def __init__(self, recipes: Sequence[str]) -> None:
        self.stats = FP8Statistics(tuple(recipes))
        self.delayed: dict[str, DelayedScaling] = {}

    def observe(self, layer: str, role: str, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            x = tensor.detach().float()
            x = x.reshape(-1, x.shape[-1])
            fmt = ROLE_FORMATS[role]
            name = f"{layer}:{role}"
            for recipe in self.stats.recipes:
                scale = None
                if recipe == "delayed":
                    state = self.delayed.setdefault(name, DelayedScaling())
                    scale = state.scale(name, fmt)
                self.stats.record(layer, role, recipe, **_errors(x, fmt, recipe, scale))
            if "delayed" in self.stats.recipes:
                amax = float(x.abs().amax()) if x.numel() else 0.0
                self.delayed[name] = self.delayed[name].update({name: amax}, False).state

    def hook(self, layer: str) -> Any:
        def forward_hook(module: nn.Linear, args: tuple[Any, ...], output: Any) -> None:
            if not args or not isinstance(args[0], torch.Tensor):
                return
            self.observe(layer, "input", args[0])
            self.observe(layer, "weight", module.weight)
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: self.observe(layer, "grad_output", grad))

        return forward_hook


@contextlib.contextmanager
def fp8_statistics(
    model: nn.Module, recipes: Sequence[str] = FP8_RECIPES
) -> Iterator[FP8Statistics]:
    """Record, while the block runs, the error every FP8 recipe would give each
    ``nn.Linear`` of ``model`` (see the module docstring); yields the
    :class:`~mixprec.fp8_stats.FP8Statistics`, complete when the block ends.

    Wrap a few training steps under any policy in ``with mixprec.torch.fp8_statistics(model)
    as stats:``, then read ``stats.table()``, ``stats.fragile("tensorwise")`` (the layers
    that recipe would hurt), ``stats.best_recipe(layer)`` and ``stats.rules("tensorwise")``
    (the module rules, ``path:<layer>=bfloat16``, that keep those layers out of FP8). No
    number of the run changes. The guide's "FP8" section has the example.

    :raises WrapError: ``model`` is not an ``nn.Module`` or has no ``nn.Linear``.
    :raises PolicyError: an unknown recipe.
    """
    if not isinstance(model, nn.Module):
        raise WrapError(
            f"fp8_statistics needs the torch.nn.Module to watch, got {type(model).__name__}"
        )
    for recipe in recipes:
        FP8Recipe(recipe)  # type: ignore[arg-type]  # PolicyError naming the recipes
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not layers:
        raise WrapError(
            f"fp8_statistics found no nn.Linear in {type(model).__name__}: FP8 runs the "
            "linear layers, so there is nothing to measure"
        )
    collector = _Collector(recipes)
    handles = [module.register_forward_hook(collector.hook(name)) for name, module in layers]
    try:
        yield collector.stats
    finally:
        for handle in handles:
            handle.remove()
