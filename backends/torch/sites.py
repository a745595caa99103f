"""The plan of a model's modules: the dtype each module's parameters take, and why.

:func:`plan_model` walks a model once, parents before children, and returns one
:class:`ModuleSite` per module: the dtype a module rule pins it to, else the dtype of its
parent (a pin covers everything inside the module), else ``policy.param`` at the root.
``wrap`` casts by this plan (:mod:`mixprec_torch.wrapping.casting`), and
:func:`mixprec_torch.wrapping.sharding.fully_shard_with_policy` shards by it, so both agree. It
reads the model and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from mixprec.errors import WrapError
from mixprec.kit import Policy

__all__ = ["ModuleSite", "class_names", "plan_model"]


def class_names(module: nn.Module) -> tuple[str, ...]:
    """The module's class and base class names (so ``*BatchNorm*`` matches subclasses)."""
    return tuple(cls.__name__ for cls in type(module).__mro__ if cls is not object)


@dataclass
class ModuleSite:
    """What the plan decided for one module."""

    name: str
    module: nn.Module
    classes: tuple[str, ...]
    pin: str | None
    dtype: str
    outer: str
    has_rule: bool


def plan_model(model: nn.Module, policy: Policy) -> list[ModuleSite]:
    """One :class:`ModuleSite` per module, parents before children.

    :raises WrapError: a parameter shared by modules that the policy puts in different dtypes.
    :raises PolicyError: module rules that match a module ambiguously.
    """
    sites: list[ModuleSite] = []

    def visit(name: str, module: nn.Module, outer: str) -> None:
        classes = class_names(module)
        pin = policy.module_dtype(name, classes)
        has_rule = any(rule.matches(name, classes) for rule in policy.modules)
        dtype = pin or outer
        sites.append(ModuleSite(name, module, classes, pin, dtype, outer, has_rule))
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child, dtype)

    visit("", model, policy.param)
    owners: dict[int, tuple[str, str]] = {}
    for site in sites:
        for pname, param in site.module.named_parameters(recurse=False):
            where = f"{site.name}.{pname}" if site.name else pname
            seen = owners.setdefault(id(param), (site.dtype, where))
            if seen[0] != site.dtype:
                raise WrapError(
                    f"parameter {where!r} is shared with {seen[1]!r}, but the policy puts them "
                    f"in different dtypes ({site.dtype} vs {seen[0]}); a tied weight has one "
                    "dtype. Give both modules the same module rule (or none)"
                )
    return sites
