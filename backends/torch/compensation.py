"""Compensated bfloat16 weights (``master=kahan|stochastic``) around any torch optimizer.

The arithmetic is :mod:`mixprec.compensated`'s (the NumPy plugin's
``mixprec_numpy.compensation`` is its readable reference). The torch form keeps the
optimizer unchanged and its update in float32:

- the optimizer's ``param_groups`` hold float32 *working* masters, as under O2, but they
  are views into one flat float32 buffer per device whose storage exists only during
  ``step()``: :meth:`Compensation.fill` allocates it and writes ``w + c`` (kahan) or ``w``
  (stochastic) with one fused foreach copy and one flat add; :meth:`Compensation.store`
  rounds the result back into the bfloat16 parameters and frees the storage again. Between
  steps the weights cost their bfloat16 values plus, under kahan, one bfloat16
  compensation buffer (flat, per device); the optimizer's own state is what it allocates
  for float32 params;
- every pass is one foreach call per device or a flat tensor op, never a Python loop over
  parameters. The two passes that mix float32 and bfloat16 operands (adding the compensation,
  taking the rounding residual) run over the flat buffers in slices
  (:func:`~.state_rounding.flat_slices`):
  a mixed-dtype elementwise op converts its bfloat16 operand into a temporary of the whole
  operand's size, and at model size that temporary is fresh memory every step
  (``python -m benchmarks.compensation_passes``: 16.8 M parameters, glibc's default malloc,
  kahan's two passes 158 ms and 49 k page faults in one piece, 82 ms and 16 k sliced, the
  16 k being the working buffer itself).
  Stochastic rounding (:func:`~.state_rounding.round_stochastic_`) adds uniform 16-bit
  noise drawn from a seeded ``torch.Generator`` to the float32 bit patterns and clears their
  low 16 bits, so the foreach copy into bfloat16 is then exact; it draws slice by slice too.

Under ``state="bfloat16"`` the optimizer's state of the compensated parameters is kept in
bfloat16 between steps too (:mod:`.state_rounding`): widened before the update, rounded
stochastically after it, on the same per-device generators.

Checkpoints: ``model.state_dict()`` saves ``w + c`` in float32 (:meth:`Compensation.best`);
``optimizer.state_dict()`` carries the exact compensation and the generator state
(:meth:`Compensation.state_dict`). Loading the model splits the saved value into ``w, c``
(:meth:`Compensation.split_loaded`); loading the optimizer afterwards puts back the saved
``c`` and re-derives ``w = nearest(saved - c)``, the weight that was saved, bit for bit
(also when the model loaded its checkpoint before ``wrap``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch

from mixprec.compensated import KAHAN, STOCHASTIC
from mixprec.errors import CheckpointError

from .state_rounding import StateRounding, flat_slices, round_stochastic_
from .torch_private import foreach_copy_

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
    """The compensated parameters of one device: their working masters share one flat
    float32 buffer, their compensations one flat bfloat16 buffer."""

    def __init__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], strategy: str) -> None:
        self.params = [p for p, _ in pairs]
        self.masters = [m for _, m in pairs]
        device = self.params[0].device
        self.numel = sum(p.numel() for p in self.params)
        self.work = torch.empty(self.numel, dtype=torch.float32, device=device)
        kahan = strategy == KAHAN
        self.comp = torch.zeros(self.numel if kahan else 0, dtype=torch.bfloat16, device=device)
        self.comp_views: list[torch.Tensor] = []
        offset = 0
        with torch.no_grad():
            for param, master in pairs:
                n = param.numel()
                view = self.work[offset : offset + n].view(param.shape)
                view.copy_(master)  # the exact float32 value from before the cast
                master.data = view
                if kahan:
                    self.comp_views.append(self.comp[offset : offset + n].view(param.shape))
                offset += n
            if kahan:  # what the bfloat16 weight cannot hold of the initial float32 value
                self.comp.copy_(self.work - self.work.to(torch.bfloat16).float())
        self.bytes = self.work.untyped_storage().nbytes()
        self.release()

    def release(self) -> None:
        self.work.untyped_storage().resize_(0)

    def allocate(self) -> None:
        self.work.untyped_storage().resize_(self.bytes)


class Compensation:
    """The kahan or stochastic state of one ``wrap`` call, and its two passes per step.

    :param pairs: (bfloat16 model parameter, its float32 master) for every compensated
        parameter; the masters are re-pointed into the flat working buffers here.
    :param strategy: ``"kahan"`` or ``"stochastic"``.
    :param seed: seeds the stochastic rounding's generator on each device.
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
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for param, master in pairs:
            by_device.setdefault(param.device, []).append((param, master))
        self.flats = [_Flat(group, strategy) for group in by_device.values()]
        self.generators: list[torch.Generator] = []
        for flat in self.flats:
            gen = torch.Generator(device=flat.work.device)
            gen.manual_seed(seed)
            self.generators.append(gen)
        self.state: StateRounding | None = None
        """Under ``state="bfloat16"``: the optimizer state's flat bfloat16 buffers."""
        if state is not None:
            self.state = StateRounding(
                [(flat.masters, gen) for flat, gen in zip(self.flats, self.generators, strict=True)]
            )
        self._handled = {id(p) for flat in self.flats for p in flat.params}
        self._comp_of = {  # empty under stochastic, which keeps no compensation
            id(p): c
            for flat in self.flats
            for p, c in zip(flat.params, flat.comp_views, strict=False)
        }
        self._loaded: dict[int, torch.Tensor] = {}
        """id(param) -> the float32 value a model load gave it, until the optimizer loads."""

    # ------------------------------------------------------------------ the step

    # Both passes resize the working masters' storage (and the bfloat16 state's), which a
    # compiled graph cannot follow (a compiled fill() wrote through the storage it had seen
    # freed: a segfault). They run eagerly, one graph break each, in an optimizer step the
    # user compiles; the optimizer's own update between them still compiles.
    @_eagerly
    def fill(self, optimizer: torch.optim.Optimizer) -> None:
        """Allocate the working masters and write ``w + c`` (kahan) or ``w`` into them;
        under ``state="bfloat16"`` widen ``optimizer``'s state to float32."""
        with torch.no_grad():
            for flat in self.flats:
                flat.allocate()
                foreach_copy_(flat.masters, flat.params)
                if self.strategy == KAHAN:
                    work, comp = flat.work, flat.comp
                    for part in flat_slices(flat.numel):
                        work[part].add_(comp[part])
        if self.state is not None:
            self.state.widen(optimizer)

    @_eagerly
    def store(self, optimizer: torch.optim.Optimizer) -> None:
        """Round the updated working masters into the bfloat16 weights, keep the kahan
        residual (or draw the stochastic rounding), free the working storage; under
        ``state="bfloat16"`` round ``optimizer``'s state stochastically back into bfloat16."""
        with torch.no_grad():
            for flat, gen in zip(self.flats, self.generators, strict=True):
                if self.strategy == STOCHASTIC:
                    round_stochastic_(flat.work, gen)  # exact in bfloat16 now
                foreach_copy_(flat.params, flat.masters)  # rounds to nearest (exact under sr)
                if self.strategy == KAHAN:
                    for part in flat_slices(flat.numel):
                        work = flat.work[part]
                        work.sub_(work.to(torch.bfloat16))  # the rounding residual
                    flat.comp.copy_(flat.work)
                flat.release()
        if self.state is not None:
            self.state.narrow(optimizer)

    # ------------------------------------------------------------------ checkpoints

    def best(self, param: torch.Tensor) -> torch.Tensor | None:
        """``float32(w) + float32(c)`` for a kahan parameter, ``float32(w)`` for a
        stochastic one, None for a parameter the strategy does not handle."""
        comp = self._comp_of.get(id(param))
        if comp is not None:
            return param.detach().float() + comp.float()
        if id(param) in self._handled:
            return param.detach().float()
        return None

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

    def state_dict(self) -> dict[str, Any]:
        """The exact compensation buffers and the generators' states."""
        return {
            "strategy": self.strategy,
            "compensation": [flat.comp.clone() for flat in self.flats],
            "generators": [gen.get_state() for gen in self.generators],
        }

    def check_state_dict(self, sd: Any) -> None:
        """Refuse a saved state that does not fit, before anything is loaded."""
        comps = sd.get("compensation") if isinstance(sd, dict) else None
        if (
            not isinstance(sd, dict)
            or sd.get("strategy") != self.strategy
            or not isinstance(comps, list)
            or [tuple(c.shape) for c in comps] != [tuple(f.comp.shape) for f in self.flats]
            or len(sd.get("generators", ())) != len(self.generators)
        ):
            raise CheckpointError(
                f"the optimizer state dict holds no master={self.strategy} state for these "
                "parameters; save it from an optimizer wrapped with the same policy and model"
            )

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Put back the saved compensation and generator states, and give each kahan
        weight ``w = nearest(value - c)``: the weight that was saved, bit for bit.

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
        for gen, state in zip(self.generators, sd["generators"], strict=True):
            gen.set_state(state)
        self._loaded.clear()

    def adopt_state(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``optimizer.load_state_dict``: under ``state="bfloat16"`` narrow the state
        torch cast to float32 back into bfloat16 (exact: it holds bfloat16 values)."""
        if self.state is not None:
            self.state.adopt(optimizer)
