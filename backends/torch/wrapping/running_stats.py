"""Running statistics of a skipped step, put back (BatchNorm, InstanceNorm with stats).

A normalisation layer in training mode updates its running mean and variance in the forward
pass, before anyone knows whether the step will be skipped. A batch holding a NaN therefore
poisons them even though the step that follows is skipped, and eval-mode outputs become NaN
from then on (``torch.amp`` has the same hole). :class:`RunningStats` closes it: a forward
pre-hook on each module with running statistics copies them, once per step, at the first
training-mode forward since the last step. The step's round checks them with the gradients
(:meth:`RunningStats.flag`: a statistic that became inf or NaN skips the step, as a huge input
can overflow a running variance while every gradient stays finite) and
(:meth:`RunningStats.settle`) puts them back when the step is skipped, forgetting the copy
otherwise.

**Per model.** A round settles only the statistics of the models its optimizers train (the
*scope*, model indices of the ``wrap`` call; a model no optimizer trains is in every scope):
in a GAN loop the discriminator's skipped step leaves the generator's statistics, updated
by the generator's forward of the same iteration, to the generator's own step.

**Never in place.** A skipped step's statistics may still be saved by an autograd graph that
has not run backward yet (the generator's forward, kept for its loss after the
discriminator's step; BatchNorm's backward saves ``running_mean``/``running_var``): writing
them in place would make that backward fail ("modified by an inplace operation"). So the
module gets the saved copy as its buffer (a new tensor object), and the tensor the graph
holds is left alone; DDP re-reads the buffers before each broadcast, so it follows.

Under ``torch.compile`` the pre-hook is traced into the graph. Its Python-level check (is
this module's copy already taken this step?) is a guard, so a step with several training
forwards (gradient accumulation) compiles one more variant of the graph, once.

Cost: one copy of each such module's statistics per step (a few floats per channel, into
buffers allocated once), nothing for modules in eval mode or without running statistics.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from ..torch_private import foreach_norm_float32

__all__ = ["STAT_NAMES", "RunningStats"]

#: The buffers a normalisation layer updates in its training-mode forward pass.
STAT_NAMES = ("running_mean", "running_var", "num_batches_tracked")


def _stats(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    found = []
    for name in STAT_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, torch.Tensor):
            found.append((name, value))
    return found


class RunningStats:
    """The running statistics of every normalisation layer of some models, with a copy
    taken at the first training-mode forward of each step."""

    def __init__(self, models: Iterable[nn.Module]) -> None:
        owners: dict[int, tuple[nn.Module, frozenset[int]]] = {}
        for index, model in enumerate(models):
            for module in model.modules():
                if any(n in STAT_NAMES for n, _ in module.named_buffers(recurse=False)):
                    held = owners.get(id(module), (module, frozenset()))[1]
                    owners[id(module)] = (module, held | {index})
        self.modules: list[nn.Module] = [module for module, _ in owners.values()]
        self.owners: list[frozenset[int]] = [held for _, held in owners.values()]
        """The indices of the models (of the ``wrap`` call) holding each of :attr:`modules`
        (a list beside it, not a dict by id: a deep copy keeps it right)."""
        with torch.no_grad():
            self._saved: dict[int, list[tuple[str, torch.Tensor]]] = {
                id(m): [(n, t.detach().clone()) for n, t in _stats(m)] for m in self.modules
            }
        """id(module) -> its statistics' names and copies (allocated here, so a compiled
        forward finds them; reallocated if a statistic changes shape, dtype or device)."""
        self._pending: set[int] = set()
        """Modules whose copy belongs to the step in progress."""
        self._handles = [m.register_forward_pre_hook(self._before_forward) for m in self.modules]

    def __len__(self) -> int:
        return len(self.modules)

    def _before_forward(self, module: nn.Module, args: object) -> None:
        key = id(module)
        if not module.training or key in self._pending:
            return
        current = _stats(module)
        saved = self._saved.get(key)
        if saved is not None and torch.compiler.is_compiling():
            # traced by torch.compile: no metadata comparison (a Python-level branch on
            # it would be one more guard); copy_ casts and crosses devices itself
            with torch.no_grad():
                for (_, copy), (_, value) in zip(saved, current, strict=True):
                    copy.copy_(value)
            self._pending.add(key)
            return
        with torch.no_grad():
            if saved is None or [(n, t.shape, t.dtype, t.device) for n, t in saved] != [
                (n, t.shape, t.dtype, t.device) for n, t in current
            ]:
                self._saved[key] = [(n, t.detach().clone()) for n, t in current]
            else:
                for (_, copy), (_, value) in zip(saved, current, strict=True):
                    copy.copy_(value)
        self._pending.add(key)

    def _in_scope(self, scope: frozenset[int]) -> list[nn.Module]:
        """The pending modules of the models in ``scope``."""
        return [
            module
            for module, owners in zip(self.modules, self.owners, strict=True)
            if id(module) in self._pending and owners & scope
        ]

    def flag(self, scope: frozenset[int]) -> torch.Tensor | None:
        """Nonzero (on the device, no host sync) when a statistic of the models in ``scope``
        updated this step is inf or NaN: a huge input can overflow a running variance while
        every gradient stays finite, so the step must be skipped too. None when no statistic
        was updated."""
        tensors = [
            value
            for module in self._in_scope(scope)
            for _, value in _stats(module)
            if value.is_floating_point()
        ]
        if not tensors:
            return None
        largest = torch.stack(foreach_norm_float32(tensors, math.inf)).max()
        return torch.isfinite(largest).logical_not().reshape(1).to(torch.float32)

    def settle(self, skipped: bool, scope: frozenset[int]) -> None:
        """End of a step's round for the models in ``scope``: put their pending modules'
        statistics back if the step was ``skipped`` (the saved copies become the buffers; the
        tensors an autograd graph may hold are not written); either way their next step
        takes fresh copies."""
        modules = self._in_scope(scope)
        if skipped:
            with torch.no_grad():
                for module in modules:
                    self._restore(module)
        for module in modules:
            self._pending.discard(id(module))

    def _restore(self, module: nn.Module) -> None:
        key = id(module)
        restored = []
        for name, copy in self._saved[key]:
            value = getattr(module, name, None)
            if isinstance(value, torch.Tensor) and value.shape == copy.shape:
                setattr(module, name, copy)  # a registered buffer: replaced, not written
                restored.append((name, copy.clone()))  # the copy the next step writes
            else:
                restored.append((name, copy))
        self._saved[key] = restored

    def remove(self) -> None:
        """Remove the forward pre-hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
