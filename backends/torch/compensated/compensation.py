"""Compensated bfloat16 weights (``master=kahan|stochastic``) around any torch optimizer.

The arithmetic is :mod:`mixprec.compensated`'s (the NumPy plugin's
``mixprec_numpy.compensation`` is its readable reference). Between steps a compensated
parameter costs its bfloat16 weight plus, under kahan, its share of one flat bfloat16
compensation buffer per device. A step takes one of two paths:

- **fused** (:meth:`Compensation.step_fused`, :mod:`mixprec_torch.compensated.fused_update`):
  torch's SGD, Adam and AdamW on the CPU. One
  pass per tensor reads the bfloat16 weight, the compensation, the gradient and the optimizer
  state and writes them back, the update rule in float32; no float32 copy of the weights
  exists at any time.
- **generic**, for every other optimizer (and on GPUs): the optimizer's ``param_groups``
  hold float32 *working* masters, views into one flat float32 buffer per device that exists
  only during ``step()``: :meth:`Compensation.fill` allocates it and writes ``w + c`` (kahan)
  or ``w`` (stochastic), the optimizer's own ``step`` updates it, :meth:`Compensation.store`
  rounds it back into the bfloat16 parameters (keeping the kahan residual, or rounding
  stochastically) and frees it. The passes that mix float32 and bfloat16 operands run over
  the flat buffers in slices (:func:`~mixprec_torch.cpu.noise.flat_slices`): a mixed-dtype op
  converts its bfloat16 operand into a temporary of the whole operand's size, fresh memory
  every step at model size.

**The masters are readable.** Outside the generic path's update the working masters hold no
memory: each is a read-only view of one float32 NaN (writing raises, reading never crashes).
``mixprec.torch.master_params(optimizer)`` calls :meth:`Compensation.materialize`, which gives
them their current values (``w + c`` or ``w``) until the next step, so the guide's EMA recipe
(``[m.detach().clone() for m in master_params(opt)]``) and gradient clipping of the masters
both work.

Stochastic rounding adds 16 bits of counter-based noise (:mod:`mixprec_torch.cpu.noise`: a
function of the seed, the step's number on the device and the element's position) to the
float32 bit patterns and clears the low 16 bits. Under ``state="bfloat16"`` the optimizer's
state of the compensated parameters is kept in bfloat16 between steps too (fused: read and
written directly; generic: :mod:`.state_rounding`).

Checkpoints: ``model.state_dict()`` saves ``w + c`` in float32 (:meth:`Compensation.best`);
``optimizer.state_dict()`` carries the exact compensation and the noise streams' seed and step
counts (:meth:`Compensation.state_dict`). Loading the model splits the saved value into
``w, c`` (:meth:`Compensation.split_loaded`); loading the optimizer afterwards puts back the
saved ``c`` and re-derives ``w = nearest(saved - c)``, the weight that was saved, bit for bit
(also when the model loaded its checkpoint before ``wrap``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch

from mixprec.errors import CheckpointError
from mixprec.kit import KAHAN, STOCHASTIC

from ..cpu.noise import Stream, flat_slices, round_stochastic_
from ..torch_private import foreach_copy_
from .fused_update import KAHAN as FUSED_KAHAN
from .fused_update import STOCHASTIC as FUSED_STOCHASTIC
from .fused_update import FusedParam, fusable_options, fusable_params, run
from .state_rounding import StateRounding

__all__ = ["Compensation"]

_EAGER_PASS = (
    "mixprec: the compensated working masters are allocated and freed around the optimizer's "
    "update, eagerly"
)

_F = TypeVar("_F", bound=Callable[..., Any])


def _eagerly(fn: _F) -> _F:
    """``fn`` run eagerly (a graph break) when a compiled function calls it."""
    return cast(_F, torch.compiler.disable(fn, reason=_EAGER_PASS))


class _Flat:
    """The compensated parameters of one device: their compensations share one flat bfloat16
    buffer; their working masters share one flat float32 buffer while it exists."""

    def __init__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], strategy: str) -> None:
        self.params = [p for p, _ in pairs]
        self.masters = [m for _, m in pairs]
        device = self.params[0].device
        self.offsets: list[int] = []
        offset = 0
        for param in self.params:
            self.offsets.append(offset)
            offset += param.numel()
        self.numel = offset
        kahan = strategy == KAHAN
        self.comp = torch.zeros(self.numel if kahan else 0, dtype=torch.bfloat16, device=device)
        self.comp_views = [
            self.comp[o : o + p.numel()].view(p.shape)
            for o, p in zip(self.offsets, self.params, strict=True)
            if kahan
        ]
        self.nan = torch.full((), float("nan"), dtype=torch.float32, device=device)
        self.work: torch.Tensor | None = None
        self.filled = False
        """The working masters hold ``w + c`` (or ``w``) for the user to read."""
        with torch.no_grad():
            exact = [m.detach().clone() for m in self.masters]  # from before the cast
            self.allocate()
            foreach_copy_(self.masters, exact)
            if kahan:  # what the bfloat16 weight cannot hold of the initial float32 value
                work = cast(torch.Tensor, self.work)
                self.comp.copy_(work - work.to(torch.bfloat16).float())
        self.release()

    def allocate(self) -> None:
        """Give the working masters memory (their values are undefined until filled)."""
        if self.work is not None:
            return
        self.work = torch.empty(self.numel, dtype=torch.float32, device=self.comp.device)
        for master, offset in zip(self.masters, self.offsets, strict=True):
            master.data = self.work[offset : offset + master.numel()].view(master.shape)

    def release(self) -> None:
        """Free the working masters' memory: each becomes a read-only view of one NaN."""
        self.work = None
        self.filled = False
        for master in self.masters:
            master.data = self.nan.expand(master.shape)

    def fill(self, kahan: bool) -> None:
        """Allocate and write ``w + c`` (kahan) or ``w`` into the working masters."""
        self.allocate()
        work = cast(torch.Tensor, self.work)
        foreach_copy_(self.masters, self.params)
        if kahan:
            for part in flat_slices(self.numel):
                work[part].add_(self.comp[part])


class Compensation:
    """The kahan or stochastic state of one ``wrap`` call, and its step.

    :param pairs: (bfloat16 model parameter, its float32 master) for every compensated
        parameter; the masters become the working masters here.
    :param strategy: ``"kahan"`` or ``"stochastic"``.
    :param seed: seeds the stochastic rounding's noise (the same on every device).
    :param state: the policy's ``state``: ``"bfloat16"`` keeps the optimizer's state of
        these parameters in bfloat16 between steps, None leaves it to the optimizer.
    """

    def __init__(
        self,
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        strategy: str,
        seed: int = 0,
        state: str | None = None,
    ) -> None:
        self.strategy = strategy
        self.seed = seed
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for param, master in pairs:
            by_device.setdefault(param.device, []).append((param, master))
        self.flats = [_Flat(group, strategy) for group in by_device.values()]
        self.streams = [Stream(seed) for _ in self.flats]
        self.state: StateRounding | None = None
        """Under ``state="bfloat16"`` on the generic path: the state's flat bfloat16 buffers."""
        bf16_state = state == "bfloat16"  # a low-bit state is mixprec_torch.lowbit's
        if bf16_state:
            self.state = StateRounding([flat.masters for flat in self.flats])
        mode = FUSED_KAHAN if strategy == KAHAN else FUSED_STOCHASTIC
        self._fused: dict[int, tuple[FusedParam, torch.Tensor, int]] = {}
        """id(master) -> (its view for the fused pass, its model parameter, its device)."""
        self._comp_of: dict[int, torch.Tensor] = {}  # id(param) -> compensation (kahan)
        self._handled: set[int] = set()  # id(param) of every compensated parameter
        for d, flat in enumerate(self.flats):
            comps: Sequence[torch.Tensor | None] = flat.comp_views or [None] * len(flat.params)
            for param, master, comp, offset in zip(
                flat.params, flat.masters, comps, flat.offsets, strict=True
            ):
                view = FusedParam(param, comp, offset, mode, bf16_state)
                self._fused[id(master)] = (view, param, d)
                self._handled.add(id(param))
                if comp is not None:
                    self._comp_of[id(param)] = comp
        self._loaded: dict[int, torch.Tensor] = {}
        """id(param) -> the float32 value a model load gave it, until the optimizer loads."""

    # ------------------------------------------------------------------ the step

    def _lookup(self, master: torch.Tensor) -> FusedParam | None:
        found = self._fused.get(id(master))
        return None if found is None else found[0]

    def fusable_params(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether every parameter of ``optimizer`` can take the fused path (the step asks
        once per layout of its groups)."""
        return fusable_params(optimizer, self._lookup)

    def fusable_options(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s class and group options take the fused path (the step
        asks once per step)."""
        return fusable_options(optimizer)

    def model_grad(self, master: torch.Tensor) -> torch.Tensor | None:
        """The gradient of the model parameter behind a compensated master (None if none)."""
        found = self._fused.get(id(master))
        return None if found is None else found[1].grad

    @_eagerly
    def step_fused(self, optimizer: torch.optim.Optimizer, *, master_grads: bool) -> None:
        """The fused update of ``optimizer``'s parameters (where :meth:`fusable_params` and
        :meth:`fusable_options`).

        :param master_grads: the masters' gradients hold this step's gradients (``unscale``
            cast them); otherwise the pass reads the model's bfloat16 gradients.
        """

        def grad_of(master: torch.Tensor, found: FusedParam | None) -> torch.Tensor | None:
            if master_grads or found is None:
                return master.grad
            return found.weight.grad

        # fusable_params() admits CPU parameters only: the CPU's flat (if any) holds them all
        cpu = [d for d, flat in enumerate(self.flats) if flat.comp.device.type == "cpu"]
        stream = self.streams[cpu[0]] if cpu else Stream(self.seed)
        for flat in self.flats:
            if flat.work is not None:  # the values read since the last step go stale now
                flat.release()
        run(optimizer, self._lookup, grad_of, [stream.key(0), stream.key(1), stream.key(2)])
        stream.draws += 1

    # Both generic passes resize the working masters' storage (and the bfloat16 state's),
    # which a compiled graph cannot follow (a compiled fill() wrote through the storage it
    # had seen freed: a segfault). They run eagerly, one graph break each, in an optimizer
    # step the user compiles; the optimizer's own update between them still compiles.
    @_eagerly
    def fill(self, optimizer: torch.optim.Optimizer) -> None:
        """Allocate the working masters and write ``w + c`` (kahan) or ``w`` into them;
        under ``state="bfloat16"`` widen ``optimizer``'s state to float32."""
        with torch.no_grad():
            for flat in self.flats:
                flat.fill(self.strategy == KAHAN)
        if self.state is not None:
            self.state.widen(optimizer)

    @_eagerly
    def store(self, optimizer: torch.optim.Optimizer) -> None:
        """Round the updated working masters into the bfloat16 weights, keep the kahan
        residual (or draw the stochastic rounding), free the working storage; under
        ``state="bfloat16"`` round ``optimizer``'s state stochastically back into bfloat16."""
        with torch.no_grad():
            for flat, stream in zip(self.flats, self.streams, strict=True):
                work = cast(torch.Tensor, flat.work)
                if self.strategy == STOCHASTIC:
                    round_stochastic_(work, stream.key(0))  # exact in bfloat16 now
                foreach_copy_(flat.params, flat.masters)  # rounds to nearest (exact under sr)
                if self.strategy == KAHAN:
                    for part in flat_slices(flat.numel):
                        piece = work[part]
                        piece.sub_(piece.to(torch.bfloat16))  # the rounding residual
                    flat.comp.copy_(work)
                flat.release()
        if self.state is not None:
            self.state.narrow(optimizer, [stream.key(1) for stream in self.streams])
        for stream in self.streams:
            stream.draws += 1

    @_eagerly
    def materialize(self) -> None:
        """Give the working masters their current values (``w + c`` or ``w``) until the
        next step, for code that reads them (``master_params``)."""
        with torch.no_grad():
            for flat in self.flats:
                if not flat.filled:
                    flat.fill(self.strategy == KAHAN)
                    flat.filled = True

    # ------------------------------------------------------------------ values

    def best(self, param: torch.Tensor) -> torch.Tensor | None:
        """``float32(w) + float32(c)`` for a kahan parameter, ``float32(w)`` for a
        stochastic one, None for a parameter the strategy does not handle."""
        comp = self._comp_of.get(id(param))
        if comp is not None:
            return param.detach().float() + comp.float()
        if id(param) in self._handled:
            return param.detach().float()
        return None

    def assign(self, param: torch.Tensor, value: torch.Tensor) -> bool:
        """Give a compensated ``param`` the float32 ``value`` (``w = nearest(value)``, under
        kahan ``c = nearest(value - w)``); False for a parameter the strategy does not
        handle."""
        if id(param) not in self._handled:
            return False
        with torch.no_grad():
            weight = value.to(torch.bfloat16)
            comp = self._comp_of.get(id(param))
            if comp is not None:
                comp.copy_(value - weight.float())
            param.copy_(weight)
        return True

    def split_loaded(self, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor | None:
        """The bfloat16 weight to load for ``param`` from a float32 ``value``; under kahan
        the compensation becomes ``nearest(value - w)``. None when not compensated."""
        if self.best(param) is None:
            return None
        value = value.detach().to(device=param.device, dtype=torch.float32)
        weight = value.to(torch.bfloat16)
        comp = self._comp_of.get(id(param))
        if comp is not None:
            with torch.no_grad():
                comp.copy_(value - weight.float())
            self._loaded[id(param)] = value.clone()
        return weight

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The exact compensation buffers and the noise streams (seed and step counts)."""
        return {
            "strategy": self.strategy,
            "compensation": [flat.comp.clone() for flat in self.flats],
            "noise": {"seed": self.seed, "draws": [s.draws for s in self.streams]},
        }

    def check_state_dict(self, sd: Any) -> None:
        """Refuse a saved state that does not fit, before anything is loaded."""
        comps = sd.get("compensation") if isinstance(sd, dict) else None
        noise = sd.get("noise") if isinstance(sd, dict) else None
        if isinstance(sd, dict) and "generators" in sd and noise is None:
            raise CheckpointError(
                f"the optimizer state dict holds master={self.strategy} state saved by an "
                "earlier mixprec, whose stochastic rounding drew from torch.Generator; this "
                "version's noise is counter-based and cannot continue that stream. Load the "
                "model's state dict alone (it holds weight + compensation) and start the "
                "optimizer afresh, or resume with the mixprec version that saved it"
            )
        draws = noise.get("draws") if isinstance(noise, dict) else None
        if (
            not isinstance(sd, dict)
            or sd.get("strategy") != self.strategy
            or not isinstance(comps, list)
            or [tuple(c.shape) for c in comps] != [tuple(f.comp.shape) for f in self.flats]
            or not isinstance(draws, list)
            or len(draws) != len(self.streams)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in draws)
            or not isinstance(noise.get("seed"), int)  # type: ignore[union-attr]
        ):
            raise CheckpointError(
                f"the optimizer state dict holds no master={self.strategy} state for these "
                "parameters; save it from an optimizer wrapped with the same policy and model"
            )

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Put back the saved compensation and noise streams, and give each kahan weight
        ``w = nearest(value - c)``: the weight that was saved, bit for bit.

        ``value`` is the float32 value the model holds: the one a model state dict loaded
        since gave it, or else ``w + c`` as they are now. The second covers a model that
        loaded its checkpoint before ``wrap`` (Lightning restores the module first): ``wrap``
        rounded that value to the nearest ``w``, which differs from the saved weight where
        the saved ``c`` is half a bfloat16 step (a tie the nearest rounding breaks to even).
        """
        with torch.no_grad():
            for flat, saved in zip(self.flats, sd["compensation"], strict=True):
                # kahan: the views tile the flat compensation (stochastic keeps none)
                saved = saved.to(flat.comp.device)
                offset = 0
                for param, view in zip(flat.params, flat.comp_views, strict=False):
                    value = self._loaded.pop(id(param), None)
                    if value is None:
                        value = param.float() + view.float()
                    view.copy_(saved[offset : offset + view.numel()].view(view.shape))
                    param.copy_(value - view.float())
                    offset += view.numel()
                if flat.work is not None:
                    flat.release()
        self.seed = int(sd["noise"]["seed"])
        for stream, draws in zip(self.streams, sd["noise"]["draws"], strict=True):
            stream.seed = self.seed
            stream.draws = int(draws)
        self._loaded.clear()

    def adopt_state(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``optimizer.load_state_dict``: under ``state="bfloat16"`` narrow the state
        torch cast to float32 back into bfloat16 (exact: it holds bfloat16 values)."""
        if self.state is not None:
            self.state.adopt(optimizer)
