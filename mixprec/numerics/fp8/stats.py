"""FP8 what-if statistics: the quantisation error each recipe would give, per layer.

A backend watches the linear layers of a model while it trains a few steps in any policy,
quantises each layer's input, weight and output gradient under every recipe on the spot,
and records here what that did to them. One run then shows which layers are FP8-fragile and
which recipe suits each, without training once per recipe. Per (layer, tensor, recipe):

``rel_mse``
    The relative mean squared error of the dequantised tensor, ``sum((deq - x)**2) /
    sum(x**2)``, computed per row of the tensor as the GEMM reads it (a token of the input
    or of the output gradient, an output row of the weight) and averaged over rows and
    calls. Per row, so that one outlier row cannot hide the error of all the others: a
    well-scaled e4m3 tensor shows about 1e-3 (3 mantissa bits), e5m2 about 4e-3.
``underflow``
    The fraction of nonzero elements that became 0: information the recipe threw away
    because the scale, chosen for the largest values, left them below the format's
    smallest subnormal.
``saturation``
    The fraction of elements clipped at the format's largest value (only ``delayed`` and
    mxfp8's blocks saturate: current scaling maps the amax onto the largest value).

:class:`FP8Statistics` holds the numbers, prints them as a table, and turns them into
advice: :meth:`~FP8Statistics.best_recipe` per layer, the :meth:`~FP8Statistics.fragile`
layers of a recipe and the module rules (``path:<layer>=bfloat16``) that keep them out of
FP8.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from mixprec.numerics.fp8.recipes import FP8_RECIPES, ROLES

__all__ = ["FP8Statistics", "QuantError", "Thresholds"]


@dataclass
class QuantError:
    """Sums over every observation of one (layer, tensor, recipe)."""

    rel_mse_sum: float = 0.0
    rows: int = 0
    nonzero: int = 0
    flushed: int = 0
    saturated: int = 0
    elements: int = 0
    observations: int = 0

    def add(
        self, rel_mse_sum: float, rows: int, nonzero: int, flushed: int, saturated: int,
        elements: int,
    ) -> None:  # fmt: skip
        """Add one observation's sums (rows with no energy or a non-finite value excluded
        from ``rows`` and ``rel_mse_sum``)."""
        self.rel_mse_sum += rel_mse_sum
        self.rows += rows
        self.nonzero += nonzero
        self.flushed += flushed
        self.saturated += saturated
        self.elements += elements
        self.observations += 1

    @property
    def rel_mse(self) -> float:
        """Mean per-row relative MSE (0.0 when no row had energy)."""
        return self.rel_mse_sum / self.rows if self.rows else 0.0

    @property
    def underflow(self) -> float:
        """Fraction of nonzero elements that became 0."""
        return self.flushed / self.nonzero if self.nonzero else 0.0

    @property
    def saturation(self) -> float:
        """Fraction of elements clipped at the format's largest value."""
        return self.saturated / self.elements if self.elements else 0.0


@dataclass(frozen=True)
class Thresholds:
    """When a tensor counts as FP8-fragile under a recipe: any limit exceeded.

    A well-scaled tensor shows a relative MSE of about 1e-3 in e4m3 and 4e-3 in e5m2, so
    the default ``rel_mse`` limit, 0.01, is several times that. ``saturation`` is no
    criterion by default: mxfp8's power-of-two block scales clip a few per cent of the
    elements by design (at most 12.5 % of their value, which ``rel_mse`` counts), and
    delayed scaling's saturation shows in ``rel_mse`` too.
    """

    rel_mse: float = 0.01
    underflow: float = 0.01
    saturation: float = math.inf

    def exceeded(self, error: QuantError) -> bool:
        """Whether ``error`` is over any limit."""
        return (
            error.rel_mse > self.rel_mse
            or error.underflow > self.underflow
            or error.saturation > self.saturation
        )


@dataclass
class FP8Statistics:
    """The what-if statistics of one run (see the module docstring)."""

    recipes: tuple[str, ...] = FP8_RECIPES
    errors: dict[tuple[str, str, str], QuantError] = field(default_factory=dict)

    def record(self, layer: str, role: str, recipe: str, **sums: Any) -> None:
        """Add one observation of ``layer``'s ``role`` tensor under ``recipe``."""
        self.errors.setdefault((layer, role, recipe), QuantError()).add(**sums)

    @property
    def layers(self) -> list[str]:
        """The layers observed, in the order they first ran."""
        return list(dict.fromkeys(layer for layer, _, _ in self.errors))

    def error(self, layer: str, recipe: str) -> float:
        """The layer's worst relative MSE over its tensors under ``recipe``."""
        found = [
            e.rel_mse for (lay, _, rec), e in self.errors.items() if (lay, rec) == (layer, recipe)
        ]
        return max(found, default=0.0)

    def fragile(self, recipe: str, limits: Thresholds = Thresholds()) -> list[str]:
        """The layers one of whose tensors is over a limit under ``recipe``."""
        return [
            layer
            for layer in self.layers
            if any(
                limits.exceeded(e)
                for (lay, _, rec), e in self.errors.items()
                if (lay, rec) == (layer, recipe)
            )
        ]

    def best_recipe(self, layer: str) -> str:
        """The recipe with the smallest worst-tensor relative MSE for ``layer`` (the first
        listed on a tie)."""
        return min(self.recipes, key=lambda recipe: self.error(layer, recipe))

    def rules(
        self, recipe: str, dtype: str = "bfloat16", limits: Thresholds = Thresholds()
    ) -> list[str]:
        """Module rules keeping the fragile layers of ``recipe`` in ``dtype``."""
        return [f"path:{layer}={dtype}" for layer in self.fragile(recipe, limits) if layer]

    def rows(self) -> list[dict[str, Any]]:
        """One plain row per (layer, tensor, recipe): the numbers of :meth:`table`."""
        return [
            {
                "layer": layer,
                "tensor": role,
                "recipe": recipe,
                "rel_mse": e.rel_mse,
                "underflow": e.underflow,
                "saturation": e.saturation,
                "observations": e.observations,
            }
            for (layer, role, recipe), e in sorted(self.errors.items(), key=self._order)
        ]

    def _order(self, item: tuple[tuple[str, str, str], QuantError]) -> tuple[int, int, int]:
        (layer, role, recipe), _ = item
        recipes = list(self.recipes)
        return (self.layers.index(layer), ROLES.index(role), recipes.index(recipe))

    def table(self, limits: Thresholds = Thresholds()) -> str:
        """The statistics as a text table, fragile entries marked with ``!``, then the best
        recipe of each layer."""
        head = (
            f"{'layer':<24} {'tensor':<11} {'recipe':<10} {'rel MSE':>9} {'underflow':>9} "
            f"{'saturated':>9}"
        )
        lines = [head, "-" * len(head)]
        for row in self.rows():
            error = self.errors[(row["layer"], row["tensor"], row["recipe"])]
            mark = " !" if limits.exceeded(error) else ""
            lines.append(
                f"{row['layer'] or '(model)':<24} {row['tensor']:<11} {row['recipe']:<10} "
                f"{_num(row['rel_mse']):>9} {_pct(row['underflow']):>9} "
                f"{_pct(row['saturation']):>9}{mark}"
            )
        lines.append("")
        lines.extend(
            f"best recipe for {layer or '(model)'}: {self.best_recipe(layer)}"
            for layer in self.layers
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-safe): the recipes and every row."""
        return {"recipes": list(self.recipes), "rows": self.rows()}


def _num(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.2e}"


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"
