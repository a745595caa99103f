"""Optimizer state kept in bfloat16 between steps (``state="bfloat16"``), for any optimizer.

The arithmetic is :mod:`mixprec.compensated`'s (the NumPy plugin's
``mixprec_numpy.compensation`` is its readable reference). This is the generic path, for any
optimizer; torch's SGD, Adam and AdamW on the CPU take the fused update instead
(:mod:`mixprec_torch.compensated.fused_update`), which reads and writes the bfloat16 state directly.
The optimizer is unchanged and updates its state in float32; only what is kept between two steps
is bfloat16:

- the *state tensors* are every floating tensor of ``optimizer.state[master]`` with the
  master's shape (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``momentum_buffer``,
  ``square_avg``, ``sum`` ...), never the ``step`` counters, for the compensated masters
  of one device, in parameter then key order;
- between steps they are views into one flat bfloat16 buffer per optimizer and device;
  :meth:`StateRounding.widen` (before the optimizer's update) allocates one flat float32
  buffer, widens the bfloat16 one into it with one exact copy and puts its views into the
  optimizer's state; :meth:`StateRounding.narrow` (after the update) rounds the flat float32
  buffer stochastically (:func:`round_stochastic_`) and copies it into the bfloat16 one
  (exact after the rounding), puts the bfloat16 views back and frees the float32 storage;
- whatever is in the state that is not the views it left (the first step's freshly
  allocated float32 moments, a loaded state dict, a tensor the user set) is gathered into
  new flat buffers with one foreach copy: the slow path, once per change of layout.

``optimizer.state_dict()`` between steps holds the bfloat16 tensors. torch's
``Optimizer.load_state_dict`` casts floating state to the parameter's dtype, float32 for
the working masters; the values are still bfloat16 ones, so :meth:`StateRounding.adopt`
narrows them back exactly, and the next step's float32 values are the saved ones bit for
bit. The noise is the strategy's counter-based stream per device (:mod:`mixprec_torch.cpu.noise`,
slot 1 of the step; its seed and step count are in the optimizer's checkpoint).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from ..cpu.noise import round_stochastic_
from ..torch_private import foreach_copy_

__all__ = ["StateRounding", "state_tensors"]

_Entry = tuple[dict[str, object], str]


def state_tensors(
    optimizer: torch.optim.Optimizer, masters: Sequence[torch.Tensor]
) -> tuple[list[_Entry], list[torch.Tensor]]:
    """The optimizer's floating per-parameter state of ``masters``: (state dict, key)
    entries and their tensors, in parameter then key order (``step`` never included)."""
    entries: list[_Entry] = []
    tensors: list[torch.Tensor] = []
    for master in masters:
        state = optimizer.state.get(master)
        if not state:
            continue
        for key, value in state.items():
            if (
                key != "step"
                and isinstance(value, torch.Tensor)
                and value.is_floating_point()
                and value.shape == master.shape
            ):
                entries.append((state, key))
                tensors.append(value)
    return entries, tensors


class _StateFlat:
    """The state tensors of one optimizer on one device: a flat bfloat16 buffer kept between
    steps, and a flat float32 one whose storage exists only inside ``step()``."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        device = tensors[0].device
        sizes = [t.numel() for t in tensors]
        total = sum(sizes)
        self.work = torch.empty(total, dtype=torch.float32, device=device)
        self.low = torch.empty(total, dtype=torch.bfloat16, device=device)
        shapes = [t.shape for t in tensors]
        self.work_views = [v.view(s) for v, s in zip(self.work.split(sizes), shapes, strict=True)]
        self.low_views = [v.view(s) for v, s in zip(self.low.split(sizes), shapes, strict=True)]
        self.bytes = self.work.untyped_storage().nbytes()
        self.release()

    def allocate(self) -> None:
        self.work.untyped_storage().resize_(self.bytes)

    def release(self) -> None:
        self.work.untyped_storage().resize_(0)

    @staticmethod
    def holds(views: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> bool:
        """Whether the optimizer's state still is exactly these views (the fast path)."""
        return len(views) == len(tensors) and all(
            v is t for v, t in zip(views, tensors, strict=True)
        )


def _put(entries: Sequence[_Entry], views: Sequence[torch.Tensor]) -> None:
    for (state, key), view in zip(entries, views, strict=True):
        state[key] = view


class StateRounding:
    """The bfloat16 optimizer state of one ``wrap`` call's compensated parameters.

    :param devices: per device, the compensated float32 working masters (the optimizer's
        parameters).
    """

    def __init__(self, devices: Sequence[Sequence[torch.Tensor]]) -> None:
        self.devices = [list(masters) for masters in devices]
        self._flats: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[_StateFlat | None]]
        self._flats = weakref.WeakKeyDictionary()

    def _cached(self, optimizer: torch.optim.Optimizer) -> list[_StateFlat | None]:
        flats = self._flats.get(optimizer)
        if flats is None:
            flats = [None] * len(self.devices)
            self._flats[optimizer] = flats
        return flats

    def widen(self, optimizer: torch.optim.Optimizer) -> None:
        """Before the update: the optimizer's state becomes float32 views of one flat buffer
        per device holding the bfloat16 values exactly."""
        flats = self._cached(optimizer)
        with torch.no_grad():
            for i, masters in enumerate(self.devices):
                entries, tensors = state_tensors(optimizer, masters)
                if not entries:
                    continue  # no state yet: the optimizer allocates it in this step
                flat = flats[i]
                if flat is not None and flat.holds(flat.low_views, tensors):
                    flat.allocate()
                    flat.work.copy_(flat.low)
                else:  # a loaded or replaced state: gather it
                    flat = flats[i] = _StateFlat(tensors)
                    flat.allocate()
                    foreach_copy_(flat.work_views, tensors)
                _put(entries, flat.work_views)

    def narrow(self, optimizer: torch.optim.Optimizer, keys: Sequence[int]) -> None:
        """After the update: round the state stochastically into the flat bfloat16 buffers,
        put their views into the optimizer's state, free the float32 storage.

        :param keys: per device, the noise key of this step's pass over the state.
        """
        flats = self._cached(optimizer)
        with torch.no_grad():
            for i, (masters, key) in enumerate(zip(self.devices, keys, strict=True)):
                entries, tensors = state_tensors(optimizer, masters)
                if not entries:
                    continue
                flat = flats[i]
                if flat is None or not flat.holds(flat.work_views, tensors):
                    # the first step's fresh float32 state (or one the update replaced)
                    if flat is not None:
                        flat.release()
                    flat = flats[i] = _StateFlat(tensors)
                    flat.allocate()
                    foreach_copy_(flat.work_views, tensors)
                round_stochastic_(flat.work, key)
                flat.low.copy_(flat.work)  # exact: the low 16 bits are clear
                _put(entries, flat.low_views)
                flat.release()

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``load_state_dict``: narrow the loaded state (float32 tensors holding
        bfloat16 values, as torch casts them) into flat bfloat16 buffers, exactly."""
        flats = self._cached(optimizer)
        with torch.no_grad():
            for i, masters in enumerate(self.devices):
                entries, tensors = state_tensors(optimizer, masters)
                if not entries:
                    flats[i] = None
                    continue
                flat = flats[i] = _StateFlat(tensors)
                foreach_copy_(flat.low_views, tensors)  # nearest: exact for bfloat16 values
                _put(entries, flat.low_views)
