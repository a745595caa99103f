"""Trainer: a policy applied to a model and its optimizer, and the mixed-precision step.

All the precision bookkeeping comes from the core: :class:`~mixprec.masters.MasterWeights`
decides which parameters get float32 masters, :class:`~mixprec.scaler.LossScaler` holds the
loss scale and counts skips, :class:`~mixprec.step.StepTracker` catches calls in the wrong
order. The training loop::

    trainer = Trainer(model, SGD(lr=0.1, momentum=0.9), policy="O2")
    loss = model.loss(x, y)    # every op in the dtype policy.decide picks
    trainer.backward()         # gradients of loss * loss_scale
    trainer.step()             # unscale, check, step or skip, update the scale, copy masters

The step itself is :class:`~mixprec_numpy.stepping.Stepping` (as in the Gluon backend).
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from collections import deque
from collections.abc import Mapping
from typing import IO, Any

import numpy as np

from mixprec.errors import CheckpointError, MixprecError
from mixprec.kit import (
    LossScaler,
    MasterWeights,
    Policy,
    ScalerCounters,
    StepGuard,
    StepTracker,
    atomic_write_bytes,
    check_scaler_without_masters,
    check_seed,
    is_low_precision,
    parse_state_format,
)
from mixprec_numpy.casting import Array, cast, float32
from mixprec_numpy.compensation import Compensation
from mixprec_numpy.devices import resolve_policy
from mixprec_numpy.fp8 import runtime_for
from mixprec_numpy.layers import MLP, Parameter
from mixprec_numpy.lowbit import LowBitState, Quantized
from mixprec_numpy.optimizer import SGD
from mixprec_numpy.stepping import KEPT_OVERFLOWS, Stepping

__all__ = ["Trainer"]


class Trainer(Stepping, ScalerCounters):
    """Converts ``model`` to ``policy`` in place and trains it with ``optimizer``.

    :param policy: a preset name, key-grammar string or :class:`~mixprec.policy.Policy`;
        ``"auto"`` resolves to float32 here (NumPy has no fast low-precision dtype).
    :param seed: seeds the random stream of ``master=stochastic`` (ignored otherwise).
    :param guard: a :class:`mixprec.StepGuard` or a dict of its options (how often repeated
        skipped steps warn); steps with non-finite gradients or a squared gradient norm
        beyond float32 are always skipped.
    """

    def __init__(
        self,
        model: MLP,
        optimizer: SGD,
        policy: str | Policy = "auto",
        *,
        device: str = "cpu",
        seed: int = 0,
        guard: StepGuard | Mapping[str, Any] | None = None,
    ) -> None:
        step_guard = StepGuard.coerce(guard)
        seed = check_seed(seed)
        self.policy = resolve_policy(policy, device)
        self.model, self.optimizer = model, optimizer
        params = model.parameters()
        targets = {p.name: self.policy.param_dtype_for(p.module, p.module_class) for p in params}
        # Masters are copied from the float32 values *before* the params are cast, so they
        # hold the exact initial weights, never upcast low-precision ones.
        self.masters = MasterWeights(
            params,
            master_dtype=self.policy.master if self.policy.uses_masters else None,
            dtype_of=lambda p: targets[p.name],
            make_master=lambda p: Parameter(p.name, cast(p.data, "float32")),
        )
        for p in params:
            p.cast_(targets[p.name])
        check_scaler_without_masters(
            self.policy,
            [p.name for p, m in self.masters.pairs if p is m and is_low_precision(p.dtype)],
        )
        strategy = self.policy.master_strategy
        self.compensation = (
            None
            if strategy is None
            else Compensation(params, strategy, seed, state=self.policy.state)
        )
        lowbit = parse_state_format(self.policy.state) if self.policy.state else None
        self.lowbit = (
            None if lowbit is None else LowBitState(lowbit, optimizer, self.masters.masters())
        )
        model.policy = self.policy
        model.fp8 = runtime_for(self.policy.fp8)
        self.scaler = LossScaler(self.policy.loss_scale, guard=step_guard)
        self.tracker = StepTracker()
        self.overflows = deque(maxlen=KEPT_OVERFLOWS)
        self._found_inf = False
        self._unchecked = False

    # ------------------------------------------------------------------ checkpoints

    def _weights(self) -> dict[str, Array]:
        # the masters, never upcast low-precision copies: exact float32 values; under a
        # compensated strategy the best float32 value it knows (weight + compensation)
        if self.compensation is not None:
            return {f"param/{p.name}": self.compensation.best(p) for p, _ in self.masters.pairs}
        return {f"param/{p.name}": float32(m.data) for p, m in self.masters.pairs}

    def save_parameters(self, file: str | os.PathLike[str] | IO[bytes]) -> None:
        """Save the weights as float32: the masters, exact (``.npz``). A path is written
        atomically (:mod:`mixprec.atomic`): a failed save leaves the previous file whole."""
        _savez(file, self._weights())

    def save(self, file: str | os.PathLike[str] | IO[bytes]) -> None:
        """Save everything a resumed run needs: weights, optimizer and loss-scaler state
        (atomically, as :meth:`save_parameters`)."""
        meta: dict[str, Any] = {
            "scaler": self.scaler.state_dict(),
            "policy": self.policy.to_dict(),
        }
        state = {f"optimizer/{n}": v for n, v in self.optimizer.state_dict().items()}
        if self.model.fp8 is not None and self.model.fp8.delayed is not None:
            meta["fp8"] = self.model.fp8.delayed.state_dict()
        if self.compensation is not None:
            buffers, meta["rng"] = self.compensation.state_dict()
            state.update((f"compensation/{n}", c) for n, c in buffers.items())
        if self.lowbit is not None:
            state.update((f"lowbit/{n}", v) for n, v in self.lowbit.state_dict().items())
        _savez(file, {"meta": np.array(json.dumps(meta)), **self._weights(), **state})

    def load(self, file: str | os.PathLike[str] | IO[bytes]) -> None:
        """Resume from :meth:`save`: masters first, then cast into the model.

        Everything is checked before anything changes (validate, then apply): a file from
        another policy or model, a malformed or non-finite value, or bad scaler state raises
        :class:`~mixprec.errors.CheckpointError` with the trainer as it was.
        """
        arrays, meta = _read(file)
        saved = _saved_policy(meta.get("policy"))
        if saved != self.policy:  # Policy equality ignores the display name
            raise CheckpointError(
                f"the checkpoint was saved under a different policy ({saved}); build the "
                f"Trainer with policy={str(saved)!r} to resume it"
            )
        fp8 = runtime_for(self.policy.fp8, meta.get("fp8"))  # checked before any change
        weights: list[tuple[Parameter, Parameter, Array, Array | None]] = []
        for param, master in self.masters.pairs:
            value = arrays.get(f"param/{param.name}")
            if value is None or value.shape != master.data.shape:
                raise CheckpointError(f"the checkpoint has no matching weight {param.name!r}")
            _finite(f"weight {param.name!r}", value)
            comp = arrays.get(f"compensation/{param.name}")
            if self.compensation is not None:
                self.compensation.check_restore(param, value, comp)
            weights.append((param, master, value, comp))
        prefix = "optimizer/"
        optimizer_state = {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}
        self.optimizer.check_state_dict(optimizer_state)
        codes: dict[str, Quantized] = {}
        if self.lowbit is not None:
            saved_codes = {
                k[len("lowbit/") :]: v for k, v in arrays.items() if k.startswith("lowbit/")
            }
            codes = self.lowbit.check_state_dict(saved_codes, optimizer_state)
        # a probe scaler takes the state first, so a malformed one raises before any change
        probe = LossScaler(self.scaler.state.fresh())
        probe.load_state_dict(meta.get("scaler"))  # type: ignore[arg-type]
        if self.compensation is not None:
            self.compensation.check_rng_state(meta.get("rng"))
        # ---- everything is checked: from here on the trainer changes
        for param, master, value, comp in weights:
            if self.compensation is not None:
                self.compensation.restore(param, value, comp)
                continue
            master.data = cast(value, master.dtype)
            if master is not param:
                param.data = cast(value, param.dtype)
        self.optimizer.load_state_dict(optimizer_state)
        if self.lowbit is not None:
            self.lowbit.load(codes)
        if self.compensation is not None:
            self.compensation.load_rng_state(meta["rng"])
        self.scaler.load_state_dict(meta["scaler"])
        self.model.fp8 = fp8
        self.tracker.reset()


def _savez(file: str | os.PathLike[str] | IO[bytes], arrays: dict[str, Array]) -> None:
    """``np.savez``; a path gets numpy's ``.npz`` ending and is written atomically.

    The archive is built in memory and then written whole (:func:`mixprec.atomic
    .atomic_write_bytes`): a write failing inside ``zipfile`` leaves its archive object
    half-closed, which complains again when it is collected. A reference plugin's
    checkpoints are small; a framework backend streams into the temporary file instead.
    """
    if not isinstance(file, (str, os.PathLike)):
        np.savez(file, **arrays)
        return
    target = os.fspath(file)
    if not target.endswith(".npz"):  # what np.savez does with a path
        target += ".npz"
    archive = io.BytesIO()
    np.savez(archive, **arrays)
    atomic_write_bytes(target, archive.getvalue())


def _read(file: str | os.PathLike[str] | IO[bytes]) -> tuple[dict[str, Array], dict[str, Any]]:
    """The arrays of a checkpoint and its metadata; never unpickles (``allow_pickle=False``)."""
    try:
        with np.load(file, allow_pickle=False) as saved:
            arrays = {name: saved[name] for name in saved.files}
        meta = json.loads(str(arrays.pop("meta")))
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
        raise CheckpointError(
            f"cannot read the checkpoint ({type(err).__name__}: {err}); pass a file that "
            "Trainer.save wrote"
        ) from err
    if not isinstance(meta, dict):
        raise CheckpointError("the checkpoint's metadata is not a JSON object")
    return arrays, meta


def _saved_policy(data: Any) -> Policy:
    try:
        return Policy.from_dict(data)
    except (MixprecError, TypeError, ValueError, AttributeError, RecursionError) as err:
        raise CheckpointError(f"the checkpoint holds a malformed policy ({err})") from err


def _finite(what: str, value: Array) -> None:
    if not (np.issubdtype(value.dtype, np.floating) and np.isfinite(value).all()):
        raise CheckpointError(f"the checkpoint's {what} holds an inf or NaN (or is no float)")
