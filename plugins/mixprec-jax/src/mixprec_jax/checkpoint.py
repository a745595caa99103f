"""Checkpoints: the state pytree as one ``.npz`` file, every array exact.

A :class:`~mixprec_jax.state.State` is a pytree of arrays, so a plain
``numpy.savez(file, *jax.tree_util.tree_leaves(state))`` already keeps everything a
resumed run needs (weights, optax state, loss scale, counters, compensation, the rounding
key). :func:`save` does that with named entries and the policy, and :func:`load` checks
before it builds anything: the policy must be the one the optimizer runs, and every array
must match the state it is loaded into in name, shape and dtype. NumPy has no bfloat16, so
bfloat16 arrays travel as their raw ``uint16`` bits and are viewed back (bit for bit).
Files are written atomically (:mod:`mixprec.atomic`) and read without pickle.
"""

from __future__ import annotations

import json
import os
from typing import IO, Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt

from mixprec.errors import CheckpointError
from mixprec.kit import Policy, atomic_path
from mixprec_jax.casting import PyTree
from mixprec_jax.state import State
from mixprec_jax.trees import leaf_names

__all__ = ["load", "save", "save_params"]

FORMAT = "mixprec-jax/1"
_META = "__meta__"
_BITS = {"bfloat16": np.uint16}


def _arrays(tree: PyTree) -> tuple[dict[str, npt.NDArray[Any]], dict[str, str]]:
    arrays, dtypes = {}, {}
    for name, leaf in zip(leaf_names(tree), jax.tree_util.tree_leaves(tree), strict=True):
        value = np.asarray(jax.device_get(leaf))
        dtype = str(jnp.dtype(value.dtype))
        dtypes[name] = dtype
        arrays[name] = value.view(_BITS[dtype]) if dtype in _BITS else value
    return arrays, dtypes


def _write(file: str | IO[bytes], arrays: dict[str, Any], meta: dict[str, Any]) -> None:
    payload = {**arrays, _META: np.array(json.dumps(meta))}
    if isinstance(file, str | os.PathLike):
        with atomic_path(file, suffix=".npz") as tmp:
            np.savez(tmp, **payload)
        return
    np.savez(file, **payload)


def save(file: str | IO[bytes], state: State, policy: Policy) -> None:
    """Write every array of ``state`` and the policy (see the module docstring)."""
    arrays, dtypes = _arrays(state)
    _write(file, arrays, {"format": FORMAT, "policy": policy.to_dict(), "dtypes": dtypes})


def save_params(file: str | IO[bytes], params: PyTree, policy: Policy) -> None:
    """Write the parameters for inference: low-precision values a strategy keeps are
    widened to float32 (exact), so the file holds what the optimizer knows."""
    if policy.master_strategy is not None:
        params = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), params)
    arrays, dtypes = _arrays(params)
    _write(file, arrays, {"format": FORMAT, "policy": policy.to_dict(), "dtypes": dtypes})


def _read(file: str | IO[bytes]) -> tuple[dict[str, npt.NDArray[Any]], dict[str, Any]]:
    try:
        with np.load(file, allow_pickle=False) as saved:
            arrays = {name: saved[name] for name in saved.files}
        meta = json.loads(str(arrays.pop(_META)))
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(
            f"{file if isinstance(file, str) else 'the file'} is not a mixprec-jax "
            f"checkpoint ({type(exc).__name__}: {exc}); write one with Optimizer.save"
        ) from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"unknown checkpoint format {meta.get('format')!r}; expected {FORMAT}"
        )
    return arrays, meta


def load(file: str | IO[bytes], like: State, policy: Policy) -> State:
    """The state :func:`save` wrote, with ``like``'s structure; checked before it is built.

    :raises CheckpointError: another policy, a missing or extra array, or one whose shape
        or dtype differs from ``like``'s.
    """
    arrays, meta = _read(file)
    saved = Policy.from_dict(meta["policy"])
    if saved != policy:  # Policy equality ignores the display name
        raise CheckpointError(
            f"the checkpoint was saved under a different policy ({saved}); build the "
            f"Optimizer with policy={str(saved)!r} to resume it"
        )
    names = leaf_names(like)
    leaves, treedef = jax.tree_util.tree_flatten(like)
    if set(names) != set(arrays):
        missing, extra = sorted(set(names) - set(arrays)), sorted(set(arrays) - set(names))
        raise CheckpointError(
            f"the checkpoint does not match this state: missing {missing[:5]}, unexpected "
            f"{extra[:5]}; load it into a state made by the same model and optimizer"
        )
    loaded = []
    for name, leaf in zip(names, leaves, strict=True):
        dtype, value = meta["dtypes"].get(name), arrays[name]
        if dtype in _BITS:
            value = value.view(jnp.dtype(dtype))
        if value.shape != tuple(leaf.shape) or jnp.dtype(value.dtype) != jnp.dtype(leaf.dtype):
            raise CheckpointError(
                f"{name}: the checkpoint has {value.dtype}{list(value.shape)}, the state "
                f"{leaf.dtype}{list(leaf.shape)}; load it into a state made by the same "
                "model, optimizer and policy"
            )
        loaded.append(value)
    return treedef.unflatten([jnp.asarray(v) for v in loaded])  # type: ignore[no-any-return]
