"""mixprec's MXNet Gluon backend: ``mixprec.mxnet.<name>`` is ``mixprec_mxnet.<name>``.

The loop::

    trainer = mixprec.mxnet.Trainer(net, "adam", {"learning_rate": 1e-3}, policy="O2-bf16")
    for x, y in data:
        with autograd.record():
            loss = loss_fn(net(x), y)
            with trainer.scale_loss(loss) as scaled:     # or right after the record block
                autograd.backward(scaled)
        trainer.step(x.shape[0])                         # skips on overflow, updates the scale

The Trainer converts ``net`` in place: O1 casts ops inside the hybridized graph (MXNet's AMP
pass with lists built from the policy); O2/O3 cast the parameters (float32 masters owned by
mixprec, for bfloat16 too), the net's inputs and outputs, and keep BatchNorm float32.
``net.save_parameters`` keeps writing float32. On CPU, MXNet computes in bfloat16 (oneDNN)
but not in float16: a float16 policy is refused there.

Modules, grouped into wings by job and named as in the PyTorch backend where they share one
(``docs/architecture.md``, "The Gluon backend", maps them). At the top: :mod:`.trainer` (the
Trainer: one class, its construction and every method the user calls), :mod:`.loop`
(``scale_loss(loss, trainer)``, ``unscale_(trainer)`` and the other loop functions,
torch-shaped), :mod:`.clipping` (``clip_global_norm`` over every context),
:mod:`.diagnostics` (``dtype_report``, ``overflowing_params``, ``underflow_fraction``),
:mod:`.conformance`, :mod:`.advisor` (``advise``) and :mod:`.plugin` (the entry point, which
never imports MXNet); beneath them :mod:`.devices` (``capabilities()``: a module named
``capabilities`` would shadow the function once imported), :mod:`.ops` (neutral families to
MXNet op names), :mod:`.bf16_kernels` (which ops have a bfloat16 CPU kernel here, probed
once), :mod:`.blocks` (the one walk of a net's blocks), :mod:`.dtypes` and
:mod:`.gluon_private` (every private MXNet name used, with its reason). The wings:
:mod:`.wrapping` (the net's conversion: refusals, casts, float32 islands, masters, one Trainer
per net, export), :mod:`.step` (the step's functions over the data-only trainer state,
``grad_req='add'``, the kvstore, BatchNorm statistics, checkpoints), :mod:`.o1` (the graph
pass, and what MXNet's own AMP lists do with each op, for the lockfile),
:mod:`.compensated` (``master=kahan|stochastic``) and :mod:`.integrations`
(``mxnet.contrib.amp``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mixprec.kit import lazy_exports

__all__ = [
    "MixprecState",
    "Trainer",
    "advise",
    "capabilities",
    "cast",
    "clip_global_norm",
    "conformance_adapter",
    "dtype_report",
    "master_params",
    "native_dtypes",
    "overflow_records",
    "overflowing_params",
    "resolve_policy",
    "scale_loss",
    "state",
    "underflow_fraction",
    "unscale",
    "unscale_",
]

_LAZY = {
    "Trainer": "mixprec_mxnet.trainer",
    "advise": "mixprec_mxnet.advisor",
    "MixprecState": "mixprec.kit",
    "master_params": "mixprec_mxnet.loop",
    "resolve_policy": "mixprec_mxnet.devices",
    "scale_loss": "mixprec_mxnet.loop",
    "state": "mixprec_mxnet.loop",
    "unscale": "mixprec_mxnet.loop",
    "unscale_": "mixprec_mxnet.loop",
    "capabilities": "mixprec_mxnet.devices",
    "native_dtypes": "mixprec_mxnet.o1.framework_amp",
    "cast": "mixprec_mxnet.dtypes",
    "clip_global_norm": "mixprec_mxnet.clipping",
    "conformance_adapter": "mixprec_mxnet.conformance",
    "dtype_report": "mixprec_mxnet.diagnostics",
    "overflowing_params": "mixprec_mxnet.diagnostics",
    "overflow_records": "mixprec_mxnet.diagnostics",
    "underflow_fraction": "mixprec_mxnet.diagnostics",
}

if TYPE_CHECKING:  # pragma: no cover
    from mixprec.kit import MixprecState

    from .advisor import advise
    from .clipping import clip_global_norm
    from .conformance import conformance_adapter
    from .devices import capabilities, resolve_policy
    from .diagnostics import (
        dtype_report,
        overflow_records,
        overflowing_params,
        underflow_fraction,
    )
    from .dtypes import cast
    from .loop import master_params, scale_loss, state, unscale, unscale_
    from .o1.framework_amp import native_dtypes
    from .trainer import Trainer

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
