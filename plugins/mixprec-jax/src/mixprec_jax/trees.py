"""Where each parameter lives: leaf names, module paths, and the dtype the policy gives it.

A flax parameter tree is ``{"params": {"encoder": {"Dense_0": {"kernel": ...}}}}``; the
leaf ``params.encoder.Dense_0.kernel`` belongs to the module whose path is
``encoder.Dense_0`` (the tree path without the ``params`` collection and the leaf's own
name), which is how module rules (``path:encoder.*``) and flax's module paths meet. Any
other pytree works the same way: a leaf's module is its tree path without its last key.

Class rules (``class:*BatchNorm*``) need the module's class, which a tree does not hold:
:func:`mixprec_jax.modules_of` records it by running the model abstractly, and the step
records it while it traces the loss.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax

from mixprec.errors import WrapError
from mixprec.kit import Policy
from mixprec_jax.casting import PyTree, is_floating

__all__ = ["Modules", "has_class_pins", "leaf_names", "module_of", "param_dtypes"]

Modules = Mapping[str, Sequence[str]]
"""Module path -> class names along the MRO, as :func:`mixprec_jax.modules_of` returns."""

COLLECTION = "params"


def _key(entry: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def leaf_names(tree: PyTree) -> list[str]:
    """Each leaf's dotted tree path (``"params.Dense_0.kernel"``), in leaf order."""
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [".".join(_key(k) for k in path) for path, _ in paths]


def module_of(name: str) -> str:
    """The module path of the leaf ``name``: without the ``params`` collection and the
    leaf's own key (``""`` is the root)."""
    parts = name.split(".")
    if parts and parts[0] == COLLECTION:
        parts = parts[1:]
    return ".".join(parts[:-1])


def param_dtypes(policy: Policy, params: PyTree, modules: Modules | None) -> list[str]:
    """The dtype the policy gives each leaf of ``params``, in leaf order.

    :raises WrapError: a leaf is not a floating array.
    """
    dtypes = []
    for name, leaf in zip(leaf_names(params), jax.tree_util.tree_leaves(params), strict=True):
        if not is_floating(leaf):
            raise WrapError(
                f"parameter {name!r} is not a floating array ({getattr(leaf, 'dtype', leaf)}); "
                "the optimizer trains floating parameters only: keep other values in the "
                "batch or in model_state"
            )
        path = module_of(name)
        classes = None if modules is None else modules.get(path)
        dtypes.append(policy.param_dtype_for(path, None if classes is None else tuple(classes)))
    return dtypes


def has_class_pins(policy: Policy) -> bool:
    """True when a class rule pins parameters to a dtype other than ``param`` (placing
    them needs the modules' classes)."""
    return any(
        rule.match == "class" and rule.dtype not in (None, policy.param) for rule in policy.modules
    )
