"""A tiny layer set with hand-written backward: linear, relu, softmax cross-entropy, an MLP.

Every op asks the model's policy which dtype to run in (``policy.decide``), casts its
inputs to it, computes (matrix products accumulate in float32, as tensor cores do) and
rounds its result to that dtype. Backward passes run in the same dtype as the forward op,
and a cast's backward casts the gradient back, just as autograd frameworks do.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from mixprec.kit import Policy, get_policy
from mixprec_numpy.casting import Array, Tensor, cast, float32, to
from mixprec_numpy.fp8 import FP8Runtime, linear_backward, linear_forward

__all__ = ["MLP", "Linear", "Parameter", "ReLU", "SoftmaxCrossEntropy", "softmax"]


@dataclass(eq=False)
class Parameter:
    """A weight: its values, their dtype, its gradient, and the module it belongs to."""

    name: str
    data: Array
    dtype: str = "float32"
    grad: Array | None = None
    module_class: str = ""

    @property
    def module(self) -> str:
        """Qualified name of the owning module (``"layers.0"`` for ``"layers.0.weight"``)."""
        return self.name.rpartition(".")[0]

    def cast_(self, dtype: str) -> None:
        """Store the values in ``dtype`` from now on."""
        self.data, self.dtype = cast(self.data, dtype), dtype

    def accumulate_grad(self, grad: Tensor) -> None:
        """Add a gradient, cast to this parameter's dtype (the backward of the weight cast)."""
        g = cast(grad.data, self.dtype)
        self.grad = g if self.grad is None else cast(float32(self.grad) + float32(g), self.dtype)


class Linear:
    """``y = x @ weight + bias`` in the dtype ``policy.decide("linear", ...)`` picks; where
    the policy's ``fp8`` applies (:meth:`~mixprec.Policy.fp8_for`) as an FP8 GEMM
    (:mod:`mixprec_numpy.fp8`) whose result is rounded to that dtype."""

    def __init__(
        self, in_features: int, out_features: int, *, rng: np.random.Generator, name: str = "linear"
    ) -> None:
        bound = 1.0 / np.sqrt(in_features)
        weight = rng.uniform(-bound, bound, (in_features, out_features)).astype(np.float32)
        self.name = name
        self.weight = Parameter(f"{name}.weight", weight, module_class="Linear")
        self.bias = Parameter(
            f"{name}.bias", np.zeros(out_features, np.float32), "float32", module_class="Linear"
        )
        self._saved: tuple[str, Array, Array, str] | None = None
        self._fp8: tuple[str, FP8Runtime | None] | None = None

    def parameters(self) -> list[Parameter]:
        return [self.weight, self.bias]

    def forward(self, x: Tensor, policy: Policy, fp8: FP8Runtime | None = None) -> Tensor:
        """The layer's output; ``fp8`` carries a model's delayed FP8 scaling state."""
        dtype = policy.decide(
            "linear", (x.dtype, self.weight.dtype), module=self.name, module_class="Linear"
        ).dtype
        recipe = policy.fp8_for(self.name, "Linear")
        if recipe is not None:  # inputs and weights go to FP8 from their own dtype
            x_c, w_c = float32(x.data), float32(self.weight.data)
            self._saved, self._fp8 = (x.dtype, x_c, w_c, dtype), (recipe.name, fp8)
            y = linear_forward(x_c, w_c, self.bias.data, recipe.name, self.name, fp8)
            return Tensor(cast(y, dtype), dtype)
        x_c, w_c, b_c = (cast(a, dtype) for a in (x.data, self.weight.data, self.bias.data))
        self._saved, self._fp8 = (x.dtype, x_c, w_c, dtype), None
        return Tensor(cast(float32(x_c) @ float32(w_c) + float32(b_c), dtype), dtype)

    def backward(self, grad: Tensor) -> Tensor:
        assert self._saved is not None, "backward() before forward()"
        input_dtype, x_c, w_c, dtype = self._saved
        g = float32(cast(grad.data, dtype))
        if self._fp8 is not None:  # FP8 GEMMs; each gradient rounded once, to its own dtype
            recipe, runtime = self._fp8
            grad_x, grad_w = linear_backward(g, x_c, w_c, recipe, self.name, runtime)
            self.weight.accumulate_grad(Tensor(grad_w, "float32"))
            self.bias.accumulate_grad(Tensor(g.sum(axis=0, dtype=np.float32), "float32"))
            return Tensor(cast(grad_x, input_dtype), input_dtype)
        self.weight.accumulate_grad(Tensor(cast(float32(x_c).T @ g, dtype), dtype))
        self.bias.accumulate_grad(Tensor(cast(g.sum(axis=0), dtype), dtype))
        return to(Tensor(cast(g @ float32(w_c).T, dtype), dtype), input_dtype)


class ReLU:
    """``max(x, 0)``: exact in every dtype, so it passes through by default."""

    def __init__(self, name: str = "relu") -> None:
        self.name = name
        self._saved: tuple[str, Array] | None = None

    def parameters(self) -> list[Parameter]:
        return []

    def forward(self, x: Tensor, policy: Policy) -> Tensor:
        dtype = policy.decide("relu", (x.dtype,), module=self.name, module_class="ReLU").dtype
        x_c = cast(x.data, dtype)
        self._saved = (x.dtype, x_c > 0)
        return Tensor(np.maximum(x_c, 0), dtype)

    def backward(self, grad: Tensor) -> Tensor:
        assert self._saved is not None, "backward() before forward()"
        input_dtype, positive = self._saved
        return to(Tensor(grad.data * positive, grad.dtype), input_dtype)


def _softmax32(x: Array) -> Array:
    shifted = float32(x) - float32(x).max(axis=-1, keepdims=True)
    e = np.exp(shifted)
    return e / e.sum(axis=-1, keepdims=True)  # type: ignore[no-any-return]


def softmax(x: Tensor, policy: Policy) -> Tensor:
    """Class probabilities in the dtype ``policy.decide("softmax", ...)`` picks."""
    dtype = policy.decide("softmax", (x.dtype,)).dtype
    return Tensor(cast(_softmax32(cast(x.data, dtype)), dtype), dtype)


class SoftmaxCrossEntropy:
    """Mean cross-entropy of softmax(logits), the ``cross_entropy`` op family."""

    def __init__(self) -> None:
        self.dtype = "float32"
        self._saved: tuple[str, Array, Array] | None = None

    def forward(self, logits: Tensor, labels: Array, policy: Policy) -> float:
        self.dtype = policy.decide("cross_entropy", (logits.dtype,)).dtype
        probs = cast(_softmax32(cast(logits.data, self.dtype)), self.dtype)
        picked = float32(probs)[np.arange(len(labels)), labels]
        with np.errstate(divide="ignore"):  # a probability rounded to 0 gives an inf loss
            loss = cast(-np.log(picked).mean(dtype=np.float32), self.dtype)
        self._saved = (logits.dtype, probs, np.asarray(labels))
        return float(loss)

    def backward(self, scale: float = 1.0) -> Tensor:
        """Gradient of ``loss * scale`` with respect to the logits."""
        assert self._saved is not None, "backward() before forward()"
        logits_dtype, probs, labels = self._saved
        grad = float32(probs).copy()
        grad[np.arange(len(labels)), labels] -= 1.0
        grad *= np.float32(scale / len(labels))
        return to(Tensor(cast(grad, self.dtype), self.dtype), logits_dtype)


class MLP:
    """Linear and ReLU layers, then softmax cross-entropy; the policy is set by a Trainer.

    Inputs are cast to the policy's ``param`` dtype at the model boundary and the logits
    to its ``output`` dtype, as O2/O3 require (under O0/O1 both are float32).
    """

    def __init__(self, sizes: list[int], *, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.layers: list[Linear | ReLU] = []
        for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes)):
            if i:
                self.layers.append(ReLU(name=f"layers.{len(self.layers)}"))
            self.layers.append(Linear(n_in, n_out, rng=rng, name=f"layers.{len(self.layers)}"))
        self.loss_fn = SoftmaxCrossEntropy()
        self.policy: Policy = get_policy("O0")
        self.fp8: FP8Runtime | None = None
        """The delayed FP8 scaling state of a policy with ``fp8`` (set by the Trainer)."""
        self._output_dtype = "float32"

    def parameters(self) -> list[Parameter]:
        return [p for layer in self.layers for p in layer.parameters()]

    def __call__(self, x: Array) -> Tensor:
        """The logits for a batch ``x``."""
        h = Tensor(cast(x, self.policy.param), self.policy.param)
        for layer in self.layers:
            h = (
                layer.forward(h, self.policy, self.fp8)
                if isinstance(layer, Linear)
                else (layer.forward(h, self.policy))
            )
        self._output_dtype = h.dtype
        return to(h, self.policy.output)

    def loss(self, x: Array, labels: Array) -> float:
        """Forward pass and mean loss; remembers what :meth:`backward` needs."""
        return self.loss_fn.forward(self(x), labels, self.policy)

    def backward(self, scale: float = 1.0) -> None:
        """Accumulate the gradients of ``loss * scale`` into every parameter."""
        grad = to(self.loss_fn.backward(scale), self._output_dtype)
        for layer in reversed(self.layers):
            grad = layer.backward(grad)

    def predict(self, x: Array) -> Array:
        """Class probabilities as float32."""
        return float32(softmax(self(x), self.policy).data)
