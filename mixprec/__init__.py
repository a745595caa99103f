"""mixprec: a framework-agnostic precision policy engine for FP16/BF16 training.

One :class:`Policy` says which ops run in float16/bfloat16 and which stay float32, how the
loss is scaled and where float32 master weights live. Backends make it concrete:
``mixprec.torch.wrap(model, optimizer, policy="O2")`` for PyTorch,
``mixprec.mxnet.Trainer(net, "adam", policy="O2-bf16")`` for Gluon, and third-party plugins
registered under the ``mixprec`` entry-point group for everything else (``mixprec.<backend>``
works for each of them).

Names are loaded on first use, so ``import mixprec`` stays cheap and never imports a
framework. Extension points: :mod:`mixprec.kit` (what a backend or plugin imports from the
core), :mod:`mixprec.engine.hookspecs` (the hooks) and :mod:`mixprec.testing` (the
conformance suite).
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
    "OP_FAMILIES": "mixprec.policy.ops",
    "Policy": "mixprec.policy.value",
    "OpRules": "mixprec.policy.value",
    "ModuleRule": "mixprec.policy.value",
    "Decision": "mixprec.policy.value",
    "get_policy": "mixprec.engine.spec",
    "preset_names": "mixprec.engine.spec",
    "load_toml": "mixprec.engine.spec",
    "resolve_auto": "mixprec.policy.presets",
    "NoScale": "mixprec.numerics.loss_scale",
    "StaticScale": "mixprec.numerics.loss_scale",
    "DynamicScale": "mixprec.numerics.loss_scale",
    "ScaleEvent": "mixprec.events",
    "EventLog": "mixprec.events",
    "LossScaler": "mixprec.engine.scaler",
    "StepGuard": "mixprec.numerics.guard",
    "RepeatedSkipWarning": "mixprec.numerics.guard",
    "MixprecState": "mixprec.engine.scaler",
    "StepTracker": "mixprec.numerics.stages",
    "Stage": "mixprec.numerics.stages",
    "MasterWeights": "mixprec.numerics.masters",
    "hookimpl": "mixprec.engine.hookspecs",
    "BackendInfo": "mixprec.backend",
    "Capabilities": "mixprec.backend",
    "DeviceCapability": "mixprec.backend",
    "load_backend": "mixprec.engine.plugins",
    "list_backends": "mixprec.engine.plugins",
    "ModuleDtypes": "mixprec.engine.diagnostics",
    "OverflowRecord": "mixprec.engine.diagnostics",
    "format_dtype_report": "mixprec.engine.diagnostics",
    "format_underflow": "mixprec.engine.diagnostics",
    "underflow_threshold": "mixprec.engine.diagnostics",
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
    from mixprec.dtypes import FormatInfo, canonical_dtype, format_info
    from mixprec.engine.diagnostics import (
        ModuleDtypes,
        OverflowRecord,
        format_dtype_report,
        format_underflow,
        underflow_threshold,
    )
    from mixprec.engine.hookspecs import hookimpl
    from mixprec.engine.plugins import list_backends, load_backend
    from mixprec.engine.scaler import LossScaler, MixprecState
    from mixprec.engine.spec import get_policy, load_toml, preset_names
    from mixprec.events import EventLog, ScaleEvent
    from mixprec.lock import check_lock, write_lock
    from mixprec.numerics.guard import RepeatedSkipWarning, StepGuard
    from mixprec.numerics.loss_scale import DynamicScale, NoScale, StaticScale
    from mixprec.numerics.masters import MasterWeights
    from mixprec.numerics.stages import Stage, StepTracker
    from mixprec.policy.ops import OP_FAMILIES
    from mixprec.policy.presets import resolve_auto
    from mixprec.policy.value import Decision, ModuleRule, OpRules, Policy


# torch and mxnet are facades (mixprec.engine.facades), listed so dir(mixprec) shows them; every
# other registered backend is reached the same way, as mixprec.<backend>.
_SUBMODULES = ("torch", "mxnet", "testing")

backend_facades(__name__, "mixprec.engine.facades")
__getattr__, __dir__ = lazy_exports(__name__, _LAZY, submodules=_SUBMODULES, facades=True)
