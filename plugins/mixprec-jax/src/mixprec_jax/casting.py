"""mixprec's dtypes as JAX dtypes, and casts of single arrays and whole pytrees.

JAX has all three dtypes natively (``jnp.bfloat16`` comes from ml_dtypes), and its casts
round to nearest even, as the other backends' do. Only floating leaves are cast: integer
labels, keys and booleans in a batch or a state pass through untouched.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import jax
import jax.numpy as jnp

from mixprec.errors import UnsupportedDtypeError
from mixprec.kit import canonical_dtype

__all__ = [
    "JAX_DTYPES",
    "PyTree",
    "cast",
    "cast_floating",
    "dtype_name",
    "is_floating",
    "jax_dtype",
    "to_float32",
]

PyTree: TypeAlias = Any
"""A JAX pytree (nested dicts, lists, tuples and NamedTuples of arrays)."""

JAX_DTYPES: dict[str, Any] = {
    "float32": jnp.float32,
    "float16": jnp.float16,
    "bfloat16": jnp.bfloat16,
}
"""Each mixprec dtype the JAX backend computes and stores in, as a JAX dtype."""


def is_floating(x: object) -> bool:
    """True for an array (or tracer) with a floating dtype."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.floating))


def dtype_name(x: Any) -> str:
    """The canonical mixprec name of an array's (or a dtype's) floating dtype."""
    return canonical_dtype(str(jnp.dtype(getattr(x, "dtype", x))))


def jax_dtype(dtype: str) -> Any:
    """The JAX dtype of a mixprec dtype name."""
    try:
        return JAX_DTYPES[canonical_dtype(dtype)]
    except KeyError:
        raise UnsupportedDtypeError(
            f"the JAX backend cannot compute in {dtype}; it knows {', '.join(JAX_DTYPES)}"
        ) from None


def cast(x: Any, dtype: str) -> Any:
    """``x`` in ``dtype`` when it is a floating array (itself when it already is)."""
    if not is_floating(x):
        return x
    target = jax_dtype(dtype)
    return x if x.dtype == target else x.astype(target)


def cast_floating(tree: PyTree, dtype: str) -> PyTree:
    """Every floating leaf of ``tree`` in ``dtype``; other leaves as they are."""
    return jax.tree_util.tree_map(lambda x: cast(x, dtype), tree)


def to_float32(tree: PyTree) -> PyTree:
    """Every floating leaf widened to float32 (exact for float16 and bfloat16)."""
    return cast_floating(tree, "float32")
