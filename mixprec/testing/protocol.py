"""What a backend hands the conformance suite: an adapter and the trainers it makes.

The suite never touches a framework. It asks the backend's api module for
``conformance_adapter()``, which returns a :class:`ConformanceAdapter`; the adapter runs
single ops under a policy and builds small :class:`ConformanceTrainer`\\ s, and the suite
compares what they report with the core (``Policy.decide``, ``DynamicScale``) in plain
Python floats.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from mixprec.policy.value import Policy

__all__ = ["ConformanceAdapter", "ConformanceTrainer"]


@runtime_checkable
class ConformanceTrainer(Protocol):
    """One small model with its optimizer, wrapped by the backend under one policy.

    Built by :meth:`ConformanceAdapter.make_trainer`. Every step trains on the same small
    batch, so two trainers made with the same policy and seed take identical steps. The
    optimizer must keep state (momentum SGD or Adam): the suite checks that a skipped step
    leaves it untouched, and that it survives a checkpoint.
    """

    def step(self, inject_inf: bool = False) -> float:
        """One full training step; returns the (unscaled) loss.

        With ``inject_inf`` the backend writes an ``inf`` into one gradient after the
        backward pass and before its own overflow check, so the step must be skipped.
        """
        ...

    def params(self) -> dict[str, list[float]]:
        """The model's parameters by name, flattened, as float values."""
        ...

    def master_params(self) -> dict[str, list[float]]:
        """The optimizer's master copy of each model parameter (same names as :meth:`params`;
        a parameter without a separate master reports its own values)."""
        ...

    def optimizer_state(self) -> dict[str, list[float]]:
        """Every optimizer state buffer (momentum, Adam moments ...), flattened, by name."""
        ...

    def loss_scale(self) -> float:
        """The loss scale the next step will use."""
        ...

    def skipped_steps(self) -> int:
        """How many steps were skipped so far."""
        ...

    def checkpoint(self) -> bytes:
        """Everything needed to resume (model, optimizer, loss scaler), as the backend's own
        save functions write it."""
        ...

    def restore(self, blob: bytes) -> None:
        """Load what :meth:`checkpoint` returned, the way a user resumes (called on a freshly
        made trainer)."""
        ...

    def saved_param_dtypes(self) -> set[str]:
        """Canonical dtypes of the parameters in the model file the backend saves."""
        ...


@runtime_checkable
class ConformanceAdapter(Protocol):
    """A backend's entry into the conformance suite (returned by ``conformance_adapter()``).

    Optional members, read with defaults when absent:

    ``device: str``
        the device, as named in ``capabilities()``, that ops and trainers run on
        (default ``"cpu"``).

    ``fp32_islands(dtype: str) -> Collection[str]``
        the op families that have no ``dtype`` kernel on this machine's device (a fact the
        backend measures), so that where a rule says ``dtype`` they run as float32 islands:
        inputs cast to float32, float32 compute, outputs cast back. The suite then expects
        float32 from :meth:`op_dtype` for them (default: none).

    ``op_module_class(op: str) -> Sequence[str] | None``
        for a backend that runs an op family as a module (flax's ``nn.BatchNorm`` is
        ``batch_norm``): the class names, along the MRO, of the module :meth:`op_dtype`
        runs ``op`` in, or None for an op run as a plain function. The suite then asks
        ``policy.decide`` with that ``module_class``, so class rules (O2's
        ``class:*BatchNorm*=float32``) apply as they do in a real model (default: None).

    ``master_strategies: Collection[str]``
        the compensated master-weight strategies (``"kahan"``, ``"stochastic"``) the
        backend runs; the suite then trains ``O3-bf16-kahan`` / ``O3-bf16-sr`` too and
        checks their arithmetic (default: none). Under a strategy the trainer's
        ``master_params()`` reports the best float32 value it knows: ``w + c`` under kahan,
        the bfloat16 weight under stochastic.

    ``state_dtypes: Collection[str]``
        the dtypes (``"bfloat16"``) the backend keeps the optimizer state in between steps
        under a strategy (the policy item ``state``); the suite then trains
        ``O3-bf16-kahan,state=bfloat16`` / ``O3-bf16-sr,state=bfloat16`` through every
        trainer test and checks that ``optimizer_state()`` stays on the bfloat16 grid and
        still moves (default: none, and such a backend must refuse ``state``). It may list
        the low-bit formats too (``"int8"``, ``"int4"``, ``"fp8"``:
        :mod:`mixprec.numerics.lowbit`): the suite then trains the policies of
        :data:`mixprec.testing.cases.LOWBIT_POLICIES` in that format through every trainer
        test (``optimizer_state()`` reports the state as kept between steps: codes and
        absmax are fine) and needs ``lowbit_quantize``; a format it does not list must be
        refused.

    ``lowbit_quantize(state, signed, values) -> (codes, absmax, decoded)``
        required when ``state_dtypes`` lists a low-bit format: encode ``values`` (a list of
        float32 values, read as one flat tensor) as the backend keeps a state tensor under
        ``state`` (``"int8"``, ``"int4(block=32)"``) with the signed map (first moment,
        momentum) or the unsigned one (second moment), and return the codes as stored (one
        byte per code, two per byte for 4 bits, as ints), each block's absmax and the
        values decoded again (as floats). The suite compares all three with
        :func:`mixprec.testing.lowbit.reference_lowbit` bit for bit.

    ``fp8_quantise(recipe, fmt, rows, scale) -> (values, scales)``
        required when the device lists FP8 recipes (``DeviceCapability.fp8_recipes``):
        quantise ``rows`` (a list of equal-length lists of floats, reduced along the last
        axis) to ``fmt`` (``"float8_e4m3fn"`` or ``"float8_e5m2"``) as the backend's FP8
        layers do under ``recipe``, and return the format values as floats (row by row)
        and the scales they were multiplied by (one per tensor, per row, or per block of
        32 of each row, row-major). ``scale`` is a ``delayed`` scale from a history (None:
        the tensor has none yet). The suite compares both with
        :func:`mixprec.testing.fp8.reference_quantise` bit for bit, and trains the FP8
        policies of :data:`mixprec.testing.cases.FP8_POLICIES` through the trainer tests.
    """

    name: str
    """The backend's name, as registered (``"torch"``, ``"numpy"``)."""

    def supported_ops(self) -> Collection[str]:
        """The neutral op families (``mixprec.policy.ops.OP_FAMILIES``) this backend maps."""
        ...

    def op_dtype(self, policy: Policy, op: str, input_dtype: str) -> str:
        """Run the backend's native op for ``op`` under ``policy`` with inputs (and weights)
        in ``input_dtype``, and return the canonical dtype it computed in.

        Raises a :class:`~mixprec.errors.MixprecError` where the backend refuses: an op the
        policy bans, or a dtype the device cannot compute in
        (:class:`~mixprec.errors.UnsupportedDtypeError`).
        """
        ...

    def make_trainer(self, policy: Policy, seed: int = 0) -> ConformanceTrainer:
        """A fresh small model and stateful optimizer wrapped under ``policy``.

        The model must have at least one op the policy runs in low precision (a linear
        layer). Raises :class:`~mixprec.errors.UnsupportedDtypeError` for a policy the device
        cannot run.
        """
        ...
