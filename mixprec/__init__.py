"""mixprec: a framework-agnostic precision policy engine for FP16/BF16 training.

One :class:`Policy` says which ops run in float16/bfloat16 and which stay float32, how the
loss is scaled and where float32 master weights live. Backends make it concrete:
``mixprec.torch.wrap(model, optimizer, policy="O2")`` for PyTorch,
``mixprec.mxnet.Trainer(net, "adam", policy="O2-bf16")`` for Gluon, and third-party plugins
registered under the ``mixprec`` entry-point group for everything else (``mixprec.<backend>``
works for each of them).

Names are loaded on first use, so ``import mixprec`` stays cheap and never imports a
framework. Extension points: :mod:`mixprec.hookspecs` (the hooks) and
:mod:`mixprec.testing` (the conformance suite).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mixprec.errors import (
    BackendNotAvailable,
    CheckpointError,
    LockError,
    LossScaleError,
    MixprecError,
    MixprecWarning,
    PluginError,
    PolicyError,
    StepOrderError,
    UnsupportedDtypeError,
    WrapError,
)
from mixprec.lazy import backend_facades, lazy_exports

__version__ = "0.1.0"

# public name -> module that defines it (imported on first attribute access)
_LAZY: dict[str, str] = {
    "canonical_dtype": "mixprec.dtypes",
    "format_info": "mixprec.dtypes",
    "FormatInfo": "mixprec.dtypes",
    "OP_FAMILIES": "mixprec.ops",
    "Policy": "mixprec.policy",
    "OpRules": "mixprec.policy",
    "ModuleRule": "mixprec.policy",
    "Decision": "mixprec.policy",
    "get_policy": "mixprec.spec",
    "preset_names": "mixprec.spec",
    "load_toml": "mixprec.spec",
    "resolve_auto": "mixprec.presets",
    "NoScale": "mixprec.loss_scale",
    "StaticScale": "mixprec.loss_scale",
    "DynamicScale": "mixprec.loss_scale",
    "ScaleEvent": "mixprec.events",
    "EventLog": "mixprec.events",
    "LossScaler": "mixprec.scaler",
    "StepGuard": "mixprec.guard",
    "RepeatedSkipWarning": "mixprec.guard",
    "MixprecState": "mixprec.scaler",
    "StepTracker": "mixprec.step",
    "Stage": "mixprec.step",
    "MasterWeights": "mixprec.masters",
    "hookimpl": "mixprec.hookspecs",
    "BackendInfo": "mixprec.backend",
    "Capabilities": "mixprec.backend",
    "DeviceCapability": "mixprec.backend",
    "load_backend": "mixprec.plugins",
    "list_backends": "mixprec.plugins",
    "ModuleDtypes": "mixprec.diagnostics",
    "OverflowRecord": "mixprec.diagnostics",
    "format_dtype_report": "mixprec.diagnostics",
    "format_underflow": "mixprec.diagnostics",
    "underflow_threshold": "mixprec.diagnostics",
    "write_lock": "mixprec.lock",
    "check_lock": "mixprec.lock",
}

__all__ = [
    "OP_FAMILIES",
    "BackendInfo",
    "BackendNotAvailable",
    "Capabilities",
    "CheckpointError",
    "Decision",
    "DeviceCapability",
    "DynamicScale",
    "EventLog",
    "FormatInfo",
    "LockError",
    "LossScaleError",
    "LossScaler",
    "MasterWeights",
    "MixprecError",
    "MixprecState",
    "MixprecWarning",
    "ModuleDtypes",
    "ModuleRule",
    "NoScale",
    "OpRules",
    "OverflowRecord",
    "PluginError",
    "Policy",
    "PolicyError",
    "RepeatedSkipWarning",
    "ScaleEvent",
    "Stage",
    "StaticScale",
    "StepGuard",
    "StepOrderError",
    "StepTracker",
    "UnsupportedDtypeError",
    "WrapError",
    "canonical_dtype",
    "check_lock",
    "format_dtype_report",
    "format_info",
    "format_underflow",
    "get_policy",
    "hookimpl",
    "list_backends",
    "load_backend",
    "load_toml",
    "preset_names",
    "resolve_auto",
    "underflow_threshold",
    "write_lock",
]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from mixprec.backend import BackendInfo, Capabilities, DeviceCapability
    from mixprec.diagnostics import (
        ModuleDtypes,
        OverflowRecord,
        format_dtype_report,
        format_underflow,
        underflow_threshold,
    )
    from mixprec.dtypes import FormatInfo, canonical_dtype, format_info
    from mixprec.events import EventLog, ScaleEvent
    from mixprec.guard import RepeatedSkipWarning, StepGuard
    from mixprec.hookspecs import hookimpl
    from mixprec.lock import check_lock, write_lock
    from mixprec.loss_scale import DynamicScale, NoScale, StaticScale
    from mixprec.masters import MasterWeights
    from mixprec.ops import OP_FAMILIES
    from mixprec.plugins import list_backends, load_backend
    from mixprec.policy import Decision, ModuleRule, OpRules, Policy
    from mixprec.presets import resolve_auto
    from mixprec.scaler import LossScaler, MixprecState
    from mixprec.spec import get_policy, load_toml, preset_names
    from mixprec.step import Stage, StepTracker


# torch and mxnet are facades (mixprec.facades), listed so dir(mixprec) shows them; every
# other registered backend is reached the same way, as mixprec.<backend>.
_SUBMODULES = ("torch", "mxnet", "testing")

backend_facades(__name__, "mixprec.facades")
__getattr__, __dir__ = lazy_exports(__name__, _LAZY, submodules=_SUBMODULES, facades=True)
