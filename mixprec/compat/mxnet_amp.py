"""``mxnet.contrib.amp``'s API on mixprec: change one import, keep the loop.

::

    from mixprec.compat import mxnet_amp as amp      # was: from mxnet.contrib import amp

    amp.init(target_dtype="bfloat16")                # a policy (O1-bf16); patches nothing
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    amp.init_trainer(trainer)                        # the same object, now a mixprec Trainer
    with autograd.record():
        loss = loss_fn(net(x), y)
        with amp.scale_loss(loss, trainer) as scaled:
            autograd.backward(scaled)
    trainer.step(x.shape[0])

The code lives in the Gluon backend's integrations (``mixprec_mxnet.integrations.contrib_amp``
and ``contrib_amp_lists``) and is imported here, so ``import mixprec`` never imports MXNet
while ``import mixprec.compat.mxnet_amp`` does. Without MXNet, importing this module raises
:class:`~mixprec.errors.BackendNotAvailable` naming the extra to install.
What differs from MXNet is listed in ``docs/migration.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from mixprec.engine.plugins import load_backend

__all__ = [
    "convert_bucketing_module",
    "convert_hybrid_block",
    "convert_model",
    "convert_symbol",
    "current_policy",
    "init",
    "init_trainer",
    "list_conditional_fp32_ops",
    "list_fp16_fp32_ops",
    "list_fp16_ops",
    "list_fp32_ops",
    "list_loss_output_functions",
    "list_lp16_fp32_ops",
    "list_lp16_ops",
    "list_lp16_use_fp32_params",
    "list_widest_type_cast",
    "scale_loss",
    "unscale",
]

load_backend("mxnet")  # BackendNotAvailable naming mixprec[mxnet] when MXNet is missing

if TYPE_CHECKING:  # pragma: no cover
    from mixprec_mxnet.integrations.contrib_amp import (
        convert_bucketing_module,
        convert_hybrid_block,
        convert_model,
        convert_symbol,
        init_trainer,
        scale_loss,
        unscale,
    )
    from mixprec_mxnet.integrations.contrib_amp_lists import (
        current_policy,
        init,
        list_conditional_fp32_ops,
        list_fp16_fp32_ops,
        list_fp16_ops,
        list_fp32_ops,
        list_loss_output_functions,
        list_lp16_fp32_ops,
        list_lp16_ops,
        list_lp16_use_fp32_params,
        list_widest_type_cast,
    )
else:
    _training = importlib.import_module("mixprec_mxnet.integrations.contrib_amp")
    _lists = importlib.import_module("mixprec_mxnet.integrations.contrib_amp_lists")
    for _name in __all__:
        globals()[_name] = getattr(_training if hasattr(_training, _name) else _lists, _name)
    del _name
