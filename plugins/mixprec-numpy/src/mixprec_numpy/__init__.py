"""mixprec's NumPy backend: the worked example for plugin authors.

A small, complete backend: float16/bfloat16 casts (:mod:`~mixprec_numpy.casting`), what the
device can do (:mod:`~mixprec_numpy.devices`), layers with hand-written backward that
ask the policy for each op's dtype (:mod:`~mixprec_numpy.layers`), an optimizer, the
mixed-precision :class:`Trainer`, and the conformance adapter.

This is the backend's api module: mixprec imports it when the ``numpy`` backend is first
used. Names are loaded on first access, so importing :mod:`mixprec_numpy.plugin` (which
Python does through this package) does not import NumPy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mixprec.kit import lazy_exports

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "capabilities": "mixprec_numpy.devices",
    "native_dtypes": "mixprec_numpy.native",
    "Tensor": "mixprec_numpy.casting",
    "cast": "mixprec_numpy.casting",
    "round_to_bfloat16": "mixprec_numpy.casting",
    "MLP": "mixprec_numpy.layers",
    "Linear": "mixprec_numpy.layers",
    "Parameter": "mixprec_numpy.layers",
    "ReLU": "mixprec_numpy.layers",
    "SoftmaxCrossEntropy": "mixprec_numpy.layers",
    "softmax": "mixprec_numpy.layers",
    "SGD": "mixprec_numpy.optimizer",
    "Trainer": "mixprec_numpy.trainer",
    "master_params": "mixprec_numpy.loop",
    "state": "mixprec_numpy.loop",
    "unscale_": "mixprec_numpy.loop",
}

__all__ = [
    "MLP",
    "SGD",
    "Linear",
    "Parameter",
    "ReLU",
    "SoftmaxCrossEntropy",
    "Tensor",
    "Trainer",
    "capabilities",
    "cast",
    "conformance_adapter",
    "master_params",
    "native_dtypes",
    "round_to_bfloat16",
    "softmax",
    "state",
    "unscale_",
]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from mixprec_numpy.casting import Tensor, cast, round_to_bfloat16
    from mixprec_numpy.conformance import NumpyConformanceAdapter
    from mixprec_numpy.devices import capabilities
    from mixprec_numpy.layers import MLP, Linear, Parameter, ReLU, SoftmaxCrossEntropy, softmax
    from mixprec_numpy.loop import master_params, state, unscale_
    from mixprec_numpy.native import native_dtypes
    from mixprec_numpy.optimizer import SGD
    from mixprec_numpy.trainer import Trainer


def conformance_adapter() -> NumpyConformanceAdapter:
    """The adapter mixprec's conformance suite drives (see :mod:`mixprec.testing`)."""
    from mixprec_numpy.conformance import NumpyConformanceAdapter

    return NumpyConformanceAdapter()


# mixprec's helper for PEP 562 lazy names: importing this package imports no NumPy
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
