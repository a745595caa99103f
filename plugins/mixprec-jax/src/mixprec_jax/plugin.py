"""Registers the JAX backend with mixprec (entry point ``jax`` in the ``mixprec`` group).

mixprec imports this module to list backends, so it imports no JAX: everything that does
lives in :mod:`mixprec_jax`, which mixprec imports on first use.
"""

from __future__ import annotations

from mixprec.kit import BackendInfo, hookimpl

__all__ = ["mixprec_register_backends"]


@hookimpl
def mixprec_register_backends() -> list[BackendInfo]:
    """The ``jax`` backend: ``mixprec_jax.Optimizer`` around an optax optimizer."""
    return [
        BackendInfo(
            name="jax",
            framework="jax",
            api_module="mixprec_jax",
            extra="jax",
            description="JAX backend: optax optimizers, flax modules, jit/pmap steps (plugin)",
        )
    ]
