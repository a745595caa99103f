"""BatchNorm running statistics of a skipped step, put back.

Gluon's ``BatchNorm`` updates ``running_mean`` and ``running_var`` in the forward pass under
``autograd.record()`` (training mode), before the Trainer knows whether the step will be
skipped. A batch holding a NaN therefore poisons them even though its step is skipped, and
inference collapses afterwards. :class:`RunningStats` copies them at the first
training-mode forward of each step; the Trainer's step checks them with the gradients
(:meth:`RunningStats.flag`: a statistic that became inf or NaN skips the step) and
(:meth:`RunningStats.settle`) copies them back when the step is skipped.

The copy is taken inside the net's ``forward`` (wrapped once, beneath the policy's input
casts), which runs whether or not the net is hybridized, and after deferred parameters got
their shapes. Cost: one copy of each BatchNorm's statistics per step (a few floats per
channel, into arrays allocated once), none for a net without BatchNorm.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mxnet import autograd, gluon, nd

__all__ = ["RunningStats"]

_STATS = ("running_mean", "running_var")


class RunningStats:
    """The running statistics of every BatchNorm block of ``net``, with the copy of the
    step in progress."""

    def __init__(self, net: gluon.Block, blocks: Iterable[gluon.Block]) -> None:
        """:param blocks: ``net``'s blocks, children first (``Block.apply``'s order; the
        Trainer's construction walk keeps them)."""
        found: list[gluon.Parameter] = []
        for block in blocks:
            if isinstance(block, gluon.nn.BatchNorm):
                for name in _STATS:
                    param = getattr(block, name, None)
                    if isinstance(param, gluon.Parameter) and param not in found:
                        found.append(param)
        self.params = found
        """The ``running_mean`` / ``running_var`` parameters, in the net's order."""
        self._saved: list[list[nd.NDArray]] | None = None
        self._pending = False
        if found:
            forward = net.forward

            def forward_keeping_stats(*args: Any, **kwargs: Any) -> Any:
                self.snapshot()
                return forward(*args, **kwargs)

            net.forward = forward_keeping_stats

    def snapshot(self) -> None:
        """Copy the statistics, at the first training-mode forward since the last step."""
        if self._pending or not autograd.is_training():
            return
        values = [p.list_data() for p in self.params]
        saved = self._saved
        if saved is None or [[a.shape for a in v] for v in saved] != [
            [a.shape for a in v] for v in values
        ]:
            self._saved = [[a.copy() for a in v] for v in values]
        else:
            for copies, arrays in zip(saved, values, strict=True):
                for copy, array in zip(copies, arrays, strict=True):
                    array.copyto(copy)
        self._pending = True

    def flag(self) -> nd.NDArray | None:
        """How many statistics updated this step hold an inf or NaN (one element; no host
        sync): a huge input can overflow a running variance while every gradient stays
        finite, so the step must be skipped too. None when no forward ran in training mode."""
        if not self._pending:
            return None
        arrays = [a for p in self.params for a in p.list_data()]
        finite = [nd.all_finite(a.astype("float32", copy=False)) for a in arrays]
        return len(finite) - nd.add_n(*[f.as_in_context(finite[0].context) for f in finite])

    def settle(self, skipped: bool) -> None:
        """End of a step: put the statistics back if the step was ``skipped``; either way
        the next step takes a fresh copy."""
        if skipped and self._pending and self._saved is not None:
            for param, copies in zip(self.params, self._saved, strict=True):
                for copy, array in zip(copies, param.list_data(), strict=True):
                    copy.copyto(array)
        self._pending = False
