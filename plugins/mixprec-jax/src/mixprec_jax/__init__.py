"""mixprec's JAX backend: mixed precision for optax optimizers, flax models and jitted steps.

::

    import mixprec.jax as mpj
    opt = mpj.Optimizer(optax.adamw(1e-3), policy="O2-bf16")   # any policy spec
    state = opt.init(params)            # a pytree: float32 masters, optax state, loss scale
    step = opt.make_step(loss_fn)       # loss_fn(params, batch) -> scalar loss; jitted
    loss, state, info = step(state, batch)   # info.skipped, info.loss_scale (arrays)
    params = opt.params(state)          # the float32 masters

Built only on mixprec's public plugin kit (docs/plugins.md): the policy, the loss-scale
state machine (:mod:`mixprec.traced_scale` for compiled steps), the compensated-weights
arithmetic and the conformance suite come from the core; this package maps them onto JAX.
Modules: :mod:`~mixprec_jax.optimizer` (the user API), :mod:`~mixprec_jax.stepping` (the
step), :mod:`~mixprec_jax.intercept` (op-level rules: flax modules and functions by name),
:mod:`~mixprec_jax.devices` (capabilities), :mod:`~mixprec_jax.compensation`,
:mod:`~mixprec_jax.lowbit` (low-bit optimizer state, an optax state transform),
:mod:`~mixprec_jax.checkpoint`, :mod:`~mixprec_jax.diagnostics`.

This is the backend's api module: mixprec imports it when the ``jax`` backend is first
used. Names are loaded on first access, so importing :mod:`mixprec_jax.plugin` (which
Python does through this package) does not import JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mixprec.kit import lazy_exports

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "Optimizer": "mixprec_jax.optimizer",
    "State": "mixprec_jax.state",
    "QuantizedArray": "mixprec_jax.lowbit",
    "quantized_state": "mixprec_jax.lowbit",
    "StepInfo": "mixprec_jax.state",
    "ScaleArrays": "mixprec_jax.state",
    "capabilities": "mixprec_jax.devices",
    "policy_scope": "mixprec_jax.intercept",
    "modules_of": "mixprec_jax.intercept",
    "explain": "mixprec_jax.diagnostics",
    "kahan_split": "mixprec_jax.compensation",
    "round_with_noise": "mixprec_jax.compensation",
}

__all__ = [
    "Optimizer",
    "QuantizedArray",
    "ScaleArrays",
    "State",
    "StepInfo",
    "capabilities",
    "conformance_adapter",
    "explain",
    "kahan_split",
    "modules_of",
    "policy_scope",
    "quantized_state",
    "round_with_noise",
]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from mixprec_jax.compensation import kahan_split, round_with_noise
    from mixprec_jax.conformance import JaxConformanceAdapter
    from mixprec_jax.devices import capabilities
    from mixprec_jax.diagnostics import explain
    from mixprec_jax.intercept import modules_of, policy_scope
    from mixprec_jax.lowbit import QuantizedArray, quantized_state
    from mixprec_jax.optimizer import Optimizer
    from mixprec_jax.state import ScaleArrays, State, StepInfo


def conformance_adapter() -> JaxConformanceAdapter:
    """The adapter mixprec's conformance suite drives (see :mod:`mixprec.testing`).

    Example::

        import mixprec.jax as mpj

        adapter = mpj.conformance_adapter()  # a backend's tests/conftest.py names it
        assert adapter.name == "jax"
    """
    from mixprec_jax.conformance import JaxConformanceAdapter

    return JaxConformanceAdapter()


# mixprec's helper for PEP 562 lazy names: importing this package imports no JAX
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
