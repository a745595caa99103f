"""``apex.amp`` on mixprec: change ``from apex import amp`` to
``from mixprec.compat import apex_amp as amp`` and the rest of the code runs unchanged.

The code lives in the PyTorch backend's integrations (``mixprec_torch.integrations.apex_amp``,
with ``apex_policy`` and ``apex_functions``) and is imported here, so ``import mixprec`` never
imports torch while ``import mixprec.compat.apex_amp`` does (never apex). Without torch,
importing this module raises :class:`~mixprec.errors.BackendNotAvailable` naming the extra
to install. What differs from apex is listed in ``docs/migration.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from mixprec.engine.plugins import load_backend

__all__ = [
    "disable_casts",
    "float_function",
    "half_function",
    "initialize",
    "load_state_dict",
    "loss_scalers",
    "master_params",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "scale_loss",
    "state_dict",
]

load_backend("torch")  # BackendNotAvailable naming mixprec[torch] when torch is missing

if TYPE_CHECKING:  # pragma: no cover
    from mixprec_torch.integrations.apex_amp import (
        disable_casts,
        float_function,
        half_function,
        initialize,
        load_state_dict,
        loss_scalers,
        master_params,
        promote_function,
        register_float_function,
        register_half_function,
        register_promote_function,
        scale_loss,
        state_dict,
    )
else:
    _apex_amp = importlib.import_module("mixprec_torch.integrations.apex_amp")
    for _name in __all__:
        globals()[_name] = getattr(_apex_amp, _name)
