"""Weight averaging (EMA, SWA) of a wrapped model, in float32.

``torch.optim.swa_utils.AveragedModel`` averages ``model.parameters()``. Under O2/O3 those
are the low-precision copies: a bfloat16 average at decay 0.999 moves by 0.001 × the
difference, below half a bfloat16 ulp for most elements, so most of the average never
moves. :class:`AveragedModel` is the same class, averaging the float32 *masters* instead:

- the average lives in the float32 masters of its deep copy of the model (a deep copy of a
  wrapped model keeps exact masters, :mod:`mixprec_torch.copies`), or in the parameter itself
  where it is float32; a low-precision parameter with no master (O3, a ``wrap`` without
  optimizer) gets a float32 accumulator here;
- ``update_parameters(model)`` reads the source model's masters (the values its optimizer
  updates), averages with the same ``avg_fn`` / ``multi_avg_fn`` rules as torch, then rounds
  the average into the copy's parameters, so ``ema_model(x)`` runs under the policy;
- ``ema_model.state_dict()`` saves the exact float32 average (the copy's masters).

:func:`ema` is the usual exponential moving average built on it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.optim import swa_utils

from mixprec.errors import WrapError

from .planning import ModelRecord

__all__ = ["AveragedModel", "ema"]

AvgFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | int], torch.Tensor]
MultiAvgFn = Callable[[Any, Any, torch.Tensor | int], None]


def _record(model: nn.Module) -> ModelRecord | None:
    """The wrap record of ``model``, or of the module it wraps (DDP's ``module``,
    ``torch.compile``'s original), or None for a plain model."""
    for module in model.modules():
        record = getattr(module, "_mixprec", None)
        if isinstance(record, ModelRecord):
            return record
    return None


def _float32_view(record: ModelRecord | None, param: torch.Tensor) -> torch.Tensor:
    """The float32 value behind ``param``: its master (``w + c`` under ``master=kahan``,
    a fresh tensor: compensated masters hold no memory between steps), else the parameter."""
    if record is not None and isinstance(param, nn.Parameter):
        compensation = record.group.compensation
        best = compensation.best(param) if compensation is not None else None
        if best is not None:
            return best
        try:
            return record.group.masters.master_for(param)
        except WrapError:  # not in the map (a parameter added after wrap): its own value
            pass
    return param


class AveragedModel(swa_utils.AveragedModel):
    """``torch.optim.swa_utils.AveragedModel`` for wrapped models: averages in float32.

    Same arguments and use as torch's: ``swa = mixprec.torch.AveragedModel(model)``, then
    ``swa.update_parameters(model)`` after ``optimizer.step()``, ``swa(x)`` to evaluate,
    ``torch.optim.swa_utils.update_bn(loader, swa)`` for BatchNorm statistics,
    ``swa.state_dict()`` (exact float32 averages) to save. ``model`` may also be an
    unwrapped float32 model, which averages exactly as torch's class does.

    :param model: the wrapped model (its deep copy holds the average).
    :param device: where the average lives (None: the model's device).
    :param avg_fn: ``avg_fn(averaged, current, num_averaged) -> new averaged``, per tensor.
    :param multi_avg_fn: the in-place list form (``get_ema_multi_avg_fn(decay)``...).
    :param use_buffers: average buffers too (else they are copied from ``model``).
    """

    def __init__(
        self,
        model: nn.Module,
        device: int | torch.device | None = None,
        avg_fn: AvgFn | None = None,
        multi_avg_fn: MultiAvgFn | None = None,
        use_buffers: bool = False,
    ) -> None:
        super().__init__(model, device, avg_fn, multi_avg_fn, use_buffers)
        record = _record(self.module)
        if record is not None and device is not None:
            # torch moved the copy's parameters; its masters (the averages) follow them
            with torch.no_grad():
                for _, master in record.group.masters.copied_pairs():
                    master.data = master.data.to(device)
        self._targets: list[torch.Tensor] = []
        """Per averaged tensor (parameters, then buffers with use_buffers), the float32
        tensor holding its average: the copy's master, the tensor itself, or an
        accumulator of its own (a low-precision tensor without a master)."""
        self._rounded: list[tuple[torch.Tensor, torch.Tensor]] = []
        """(model-facing tensor, its float32 average) where the two differ."""
        self._compensation = record.group.compensation if record is not None else None
        """The copy's own compensated strategy: the average goes into ``w + c``."""
        for tensor in self._averaged_tensors(self.module):
            target = _float32_view(record, tensor).detach()
            if target.is_floating_point() and target.dtype != torch.float32:
                target = tensor.detach().float()
            if target is not tensor and target.data_ptr() != tensor.data_ptr():
                self._rounded.append((tensor.detach(), target))
            self._targets.append(target)

    def _averaged_tensors(self, module: nn.Module) -> Iterator[torch.Tensor]:
        params: Iterator[torch.Tensor] = iter(module.parameters())
        if self.use_buffers:
            return itertools.chain(params, module.buffers())
        return params

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        """Fold ``model``'s current float32 values (its masters) into the average."""
        record = _record(model)
        sources = list(self._averaged_tensors(model))
        if len(sources) != len(self._targets):
            raise WrapError(
                f"update_parameters got a model with {len(sources)} averaged tensors, but this "
                f"average holds {len(self._targets)}; pass the model it was built from"
            )
        pairs = []
        for target, tensor in zip(self._targets, sources, strict=True):
            source = _float32_view(record, tensor).detach().to(target.device)
            if source.is_floating_point() and source.dtype != target.dtype:
                source = source.to(target.dtype)
            pairs.append((target, source))
        if self.n_averaged == 0:
            for target, source in pairs:
                target.copy_(source)
        else:
            self._average([t for t, _ in pairs], [s for _, s in pairs])
        for tensor, target in self._rounded:
            if self._compensation is None or not self._compensation.assign(tensor, target):
                tensor.copy_(target)  # rounds into the copy's low-precision parameters
        if not self.use_buffers:
            # as torch: buffers are not averaged but follow the source model
            for mine, theirs in zip(self.module.buffers(), model.buffers(), strict=True):
                mine.copy_(theirs.detach().to(mine.device))
        self.n_averaged += 1

    def _average(self, targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        """torch's rules: ``multi_avg_fn`` (or, with neither function, the SWA mean) on lists
        per device and dtype, else ``avg_fn`` per tensor."""
        if self.multi_avg_fn is None and self.avg_fn is not None:
            for target, source in zip(targets, sources, strict=True):
                target.copy_(self.avg_fn(target, source, self.n_averaged.to(target.device)))
            return
        multi = self.multi_avg_fn or swa_utils.get_swa_multi_avg_fn()
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[Any], list[Any]]] = {}
        for target, source in zip(targets, sources, strict=True):
            mine, theirs = groups.setdefault((target.device, target.dtype), ([], []))
            mine.append(target)
            theirs.append(source)
        for (device, _), (mine, theirs) in groups.items():
            multi(mine, theirs, self.n_averaged.to(device))


def ema(model: nn.Module, decay: float = 0.999, *, use_buffers: bool = False) -> AveragedModel:
    """An exponential moving average of ``model``'s float32 masters.

    ``average = decay * average + (1 - decay) * master`` after each
    ``ema_model.update_parameters(model)``; the first update copies the masters.

    :param decay: in [0, 1).
    :param use_buffers: average buffers (BatchNorm statistics) too, as torch's
        ``AveragedModel(use_buffers=True)``.
    """
    if not 0.0 <= decay < 1.0:
        raise WrapError(
            f"ema decay must be in [0, 1), got {decay}; typical values are 0.999 or 0.9999"
        )
    return AveragedModel(
        model, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(decay), use_buffers=use_buffers
    )
