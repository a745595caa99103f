"""Lightning integration: ``mixprec.lightning.MixprecPrecision`` is a Lightning precision plugin.

::

    import lightning
    from mixprec.lightning import MixprecPrecision

    trainer = lightning.Trainer(plugins=[MixprecPrecision("O2-bf16")])

The plugin lives in the PyTorch backend's integrations (``mixprec_torch.integrations.lightning``)
and is imported here, so ``import mixprec`` never imports torch or lightning, while ``import
mixprec.lightning`` imports both. Without lightning installed, importing this module raises
:class:`~mixprec.errors.BackendNotAvailable` naming the extra to install.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from mixprec.engine.plugins import load_backend
from mixprec.errors import BackendNotAvailable

__all__ = ["MixprecPrecision"]

try:
    importlib.import_module("lightning.pytorch")
except ImportError as exc:
    raise BackendNotAvailable(
        f"mixprec.lightning needs the lightning package, which could not be imported ({exc}). "
        "Install it with: pip install 'mixprec[lightning]'"
    ) from exc

load_backend("torch")  # the plugin runs on the torch backend: same error if torch is missing

if TYPE_CHECKING:  # pragma: no cover
    from mixprec_torch.integrations.lightning import MixprecPrecision
else:
    _plugin = importlib.import_module("mixprec_torch.integrations.lightning")
    MixprecPrecision = _plugin.MixprecPrecision
