"""mixprec's PyTorch backend: ``mixprec.torch.<name>`` is ``mixprec_torch.<name>``.

The loop::

    model, optimizer = mixprec.torch.wrap(model, optimizer, policy="O2")
    optimizer.zero_grad()
    loss = loss_fn(model(x), y)
    with mixprec.torch.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    mixprec.torch.unscale_(optimizer)                 # only before clipping
    torch.nn.utils.clip_grad_norm_(mixprec.torch.master_params(optimizer), 1.0)
    optimizer.step()                                  # skips on overflow, updates the scale

The package is grouped by job into wings, each importing only from the wings below it
(docs/architecture.md has the tree; the import-linter contract in pyproject.toml checks it):

- the base, at the top level: :mod:`.plugin` (the entry point, which never imports torch),
  :mod:`.presets` (the ``torch-autocast`` presets), :mod:`.dtypes`, :mod:`.ops` (neutral
  families to torch callables), :mod:`.torch_private` (every private torch name),
  :mod:`.devices` (``capabilities()``; not ``capabilities.py``, which would shadow the lazy
  function), :mod:`.sites` (each module's planned dtype), :mod:`.copies` (deep copies of
  wrapped models keep exact masters; pickles and optimizer copies refuse);
- :mod:`.cpu`: mixprec's C kernels (:mod:`.cpu.clib`) and their torch twins;
- :mod:`.o1`: op-level casting (:mod:`.o1.autocast`, the kernels at torch's Autocast dispatch
  keys in :mod:`.o1.autocast_kernels`, the regions they read, the operators they sit on, the
  decisions they look up, the probes) and :mod:`.o1.framework_autocast` (what torch.autocast
  itself does with each op, for the lockfile);
- :mod:`.step`: the step protocol top to bottom (:mod:`.step.protocol`), the patched
  optimizer, its data (:mod:`.step.optimizer_state`), the user's loop calls
  (:mod:`.step.loop`: ``scale_loss``, ``unscale_``, ``master_params``, ``state``), the
  per-step found_inf all-reduce (:mod:`.step.distributed`), checkpoints (``save``) and
  diagnostics (``dtype_report``, ``overflowing_params``, ``underflow_fraction``);
- :mod:`.compensated` (``master=kahan|stochastic``, ``state="bfloat16"``) and :mod:`.fp8`
  (FP8 linear layers, ``fp8_statistics``);
- :mod:`.wrapping`: ``wrap`` (:mod:`.wrapping.wrap` = :mod:`.wrapping.planning`, every check,
  then apply), parameter, boundary and island casting, DDP/FSDP2 recipes
  (:mod:`.wrapping.sharding`, exported here too), weight averages (``AveragedModel``,
  ``ema``);
- at the top: :mod:`.integrations` (apex.amp, Lightning's ``MixprecPrecision``),
  :mod:`.advisor` (``advise``: which policy for this model here; not ``advise.py``, which
  would shadow the lazy function) and :mod:`.conformance` (the conformance-suite adapter).

The MXNet backend uses the same wing and module names where it can. No wing is named like a
lazy export: a subpackage ``wrap/`` would replace the ``wrap`` function once imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mixprec.kit import lazy_exports

__all__ = [
    "AveragedModel",
    "MixprecState",
    "advise",
    "all_reduce_found_inf",
    "capabilities",
    "checkpoint_context",
    "conformance_adapter",
    "dtype_report",
    "ema",
    "float32_state_dict",
    "fp8_statistics",
    "fsdp_mixed_precision_policy",
    "fully_shard_with_policy",
    "get_state_dict",
    "load",
    "master_params",
    "native_dtypes",
    "overflow_records",
    "overflowing_params",
    "register_ddp_reduce_hook",
    "save",
    "scale_loss",
    "set_state_dict",
    "state",
    "underflow_fraction",
    "unscale_",
    "wrap",
]

_LAZY = {
    "wrap": "mixprec_torch.wrapping.wrap",
    "AveragedModel": "mixprec_torch.wrapping.averaging",
    "ema": "mixprec_torch.wrapping.averaging",
    "advise": "mixprec_torch.advisor",
    "scale_loss": "mixprec_torch.step.loop",
    "unscale_": "mixprec_torch.step.loop",
    "master_params": "mixprec_torch.step.loop",
    "state": "mixprec_torch.step.loop",
    "save": "mixprec_torch.step.checkpoint",
    "load": "mixprec_torch.step.checkpoint",
    "get_state_dict": "mixprec_torch.step.checkpoint",
    "set_state_dict": "mixprec_torch.step.checkpoint",
    "checkpoint_context": "mixprec_torch.o1.recompute",
    "MixprecState": "mixprec.kit",
    "capabilities": "mixprec_torch.devices",
    "native_dtypes": "mixprec_torch.o1.framework_autocast",
    "conformance_adapter": "mixprec_torch.conformance",
    "fully_shard_with_policy": "mixprec_torch.wrapping.sharding",
    "fsdp_mixed_precision_policy": "mixprec_torch.wrapping.sharding",
    "register_ddp_reduce_hook": "mixprec_torch.wrapping.sharding",
    "all_reduce_found_inf": "mixprec_torch.step.distributed",
    "dtype_report": "mixprec_torch.step.diagnostics",
    "fp8_statistics": "mixprec_torch.fp8.statistics",
    "float32_state_dict": "mixprec_torch.lowbit.state",
    "overflowing_params": "mixprec_torch.step.diagnostics",
    "overflow_records": "mixprec_torch.step.diagnostics",
    "underflow_fraction": "mixprec_torch.step.diagnostics",
    # not public (not in __all__): the lines `mixprec backends` prints under torch
    "backend_notes": "mixprec_torch.cpu.clib",
}

if TYPE_CHECKING:  # pragma: no cover
    from mixprec.kit import MixprecState
    from mixprec_torch.advisor import advise
    from mixprec_torch.conformance import conformance_adapter
    from mixprec_torch.devices import capabilities
    from mixprec_torch.fp8.statistics import fp8_statistics
    from mixprec_torch.o1.framework_autocast import native_dtypes
    from mixprec_torch.o1.recompute import checkpoint_context
    from mixprec_torch.step.checkpoint import load, save
    from mixprec_torch.step.diagnostics import (
        dtype_report,
        overflow_records,
        overflowing_params,
        underflow_fraction,
    )
    from mixprec_torch.step.distributed import all_reduce_found_inf
    from mixprec_torch.step.loop import master_params, scale_loss, state, unscale_
    from mixprec_torch.wrapping.averaging import AveragedModel, ema
    from mixprec_torch.wrapping.sharding import (
        fsdp_mixed_precision_policy,
        fully_shard_with_policy,
        register_ddp_reduce_hook,
    )
    from mixprec_torch.wrapping.wrap import wrap

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
