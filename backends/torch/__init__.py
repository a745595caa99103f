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

Modules (the MXNet backend uses the same names where it can; docs/architecture.md has the
table with each module's floor): :mod:`.wrapping` (``wrap`` = :mod:`.planning`, every check,
then apply), :mod:`.stepping` (the step protocol, top to bottom), :mod:`.loop`
(``scale_loss``, ``unscale_``, ``master_params``, ``state``), :mod:`.optimizer` (the patched
optimizer class), :mod:`.optimizer_state` (data: wrap group, master map, per-optimizer
state), :mod:`.sites` (each module's planned dtype), :mod:`.casting` (parameter, boundary and
island casting), :mod:`.autocast` (O1 op-level casting), :mod:`.ops` (neutral families to
torch callables), :mod:`.probes` (the op-family probe calls), :mod:`.native` (what
torch.autocast does with each op, for the lockfile), :mod:`.checkpoint` (state
dicts; ``save``, ``torch.save`` written atomically), :mod:`.diagnostics` (``dtype_report``,
``overflowing_params``, ``underflow_fraction``), :mod:`.devices` (``capabilities()``; not
``capabilities.py``, which would shadow the lazy function), :mod:`.dtypes`, :mod:`.distributed`
(the per-step found_inf all-reduce, ``all_reduce_found_inf``), :mod:`.sharding` (DDP/FSDP2 recipes:
``fully_shard_with_policy``, ``fsdp_mixed_precision_policy``, ``register_ddp_reduce_hook``,
exported here too), :mod:`.torch_private` (every private torch name), :mod:`.presets` (the
``torch-autocast`` presets), :mod:`.conformance` (the conformance-suite adapter), :mod:`.advisor`
(``advise``: which policy for this model here; not ``advise.py``, which would shadow the
lazy function), :mod:`.lightning` (``MixprecPrecision``), :mod:`.copies` (deep copies
of wrapped models keep exact masters; pickles and optimizer copies refuse),
:mod:`.averaging` (``AveragedModel``, ``ema``: weight averages in float32),
:mod:`.recompute` (``checkpoint_context``), :mod:`.kernels`, :mod:`.regions` and
:mod:`.aten` (O1's kernels at torch's Autocast dispatch keys, the regions they read, the
operators they sit on) and :mod:`.plugin` (the entry point, which never imports torch).
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
    "fp8_statistics",
    "fsdp_mixed_precision_policy",
    "fully_shard_with_policy",
    "master_params",
    "native_dtypes",
    "overflow_records",
    "overflowing_params",
    "register_ddp_reduce_hook",
    "save",
    "scale_loss",
    "state",
    "underflow_fraction",
    "unscale_",
    "wrap",
]

_LAZY = {
    "wrap": "mixprec_torch.wrapping",
    "AveragedModel": "mixprec_torch.averaging",
    "ema": "mixprec_torch.averaging",
    "advise": "mixprec_torch.advisor",
    "scale_loss": "mixprec_torch.loop",
    "unscale_": "mixprec_torch.loop",
    "master_params": "mixprec_torch.loop",
    "state": "mixprec_torch.loop",
    "save": "mixprec_torch.checkpoint",
    "checkpoint_context": "mixprec_torch.recompute",
    "MixprecState": "mixprec.scaler",
    "capabilities": "mixprec_torch.devices",
    "native_dtypes": "mixprec_torch.native",
    "conformance_adapter": "mixprec_torch.conformance",
    "fully_shard_with_policy": "mixprec_torch.sharding",
    "fsdp_mixed_precision_policy": "mixprec_torch.sharding",
    "register_ddp_reduce_hook": "mixprec_torch.sharding",
    "all_reduce_found_inf": "mixprec_torch.distributed",
    "dtype_report": "mixprec_torch.diagnostics",
    "fp8_statistics": "mixprec_torch.fp8_stats",
    "overflowing_params": "mixprec_torch.diagnostics",
    "overflow_records": "mixprec_torch.diagnostics",
    "underflow_fraction": "mixprec_torch.diagnostics",
}

if TYPE_CHECKING:  # pragma: no cover
    from mixprec.kit import MixprecState
    from mixprec_torch.advisor import advise
    from mixprec_torch.averaging import AveragedModel, ema
    from mixprec_torch.checkpoint import save
    from mixprec_torch.conformance import conformance_adapter
    from mixprec_torch.devices import capabilities
    from mixprec_torch.diagnostics import (
        dtype_report,
        overflow_records,
        overflowing_params,
        underflow_fraction,
    )
    from mixprec_torch.distributed import all_reduce_found_inf
    from mixprec_torch.fp8_stats import fp8_statistics
    from mixprec_torch.loop import master_params, scale_loss, state, unscale_
    from mixprec_torch.native import native_dtypes
    from mixprec_torch.recompute import checkpoint_context
    from mixprec_torch.sharding import (
        fsdp_mixed_precision_policy,
        fully_shard_with_policy,
        register_ddp_reduce_hook,
    )
    from mixprec_torch.wrapping import wrap

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
