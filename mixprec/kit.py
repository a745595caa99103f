"""The plugin kit: everything a backend or a plugin imports from the core, in one module.

Backends (``mixprec_torch``, ``mixprec_mxnet``) and plugins (``mixprec_numpy``,
``mixprec_jax``, a third party's) import the core through this module alone, besides
:mod:`mixprec.errors`, :mod:`mixprec.testing` and the public face (``mixprec``). A name in
``__all__`` is the stable surface: it keeps its meaning across releases, and a change to it is
announced in the changelog. Every other core module may move or change between releases, and
import-linter's ``forbidden`` contracts (``pyproject.toml``) keep the backends and plugins off
them.

The names come in seven groups:

- **policy and resolution**: the :class:`Policy` value, its op vocabulary, dtype facts,
  spec parsing and ``auto`` resolution, the loss-scale configurations, the lint checks a
  backend runs at wrap time;
- **step machinery**: the stage machine, the step guard, the loss scaler, master-weight
  bookkeeping and the traceable scale update of functional backends;
- **compensated and FP8**: the compensated master strategies and the FP8 recipes, delayed
  scaling and what-if statistics;
- **low-bit optimizer state**: the ``int8``/``int4``/``fp8`` state formats, their maps and
  sizes;
- **reports**: dtype and overflow reports, and the advisor's run;
- **plugin plumbing**: the hook marker, capabilities, backend lookup and lazy facades;
- **atomic writes**: files written whole or not at all.

The reference page is ``docs/reference/kit.md``; ``tests/test_docs_kit.py`` checks that every
name here is on it.
"""

from __future__ import annotations

from mixprec.advisor.report import AdviceReport, ModuleSensitivity
from mixprec.advisor.run import RSS_MEASURE, AdviceError, run_advice
from mixprec.atomic import atomic_path, atomic_write_bytes, atomic_write_text
from mixprec.backend import (
    BackendInfo,
    Capabilities,
    DeviceCapability,
    NativeDtypes,
    UnseenOp,
)
from mixprec.dtypes import (
    BFLOAT16,
    FLOAT16,
    FLOAT32,
    canonical_dtype,
    format_info,
    is_floating,
    is_low_precision,
    widest,
)
from mixprec.engine.diagnostics import (
    ModuleDtypes,
    OverflowRecord,
    dtype_rows,
    format_dtype_report,
    underflow_threshold,
)
from mixprec.engine.hookspecs import hookimpl
from mixprec.engine.plugins import list_backends, load_backend
from mixprec.engine.scaler import LossScaler, MixprecState, ScalerCounters
from mixprec.engine.spec import get_policy, resolve_for_device
from mixprec.engine.visibility import check_rules_visible, unseen_notes
from mixprec.lazy import lazy_exports
from mixprec.numerics.compensated import KAHAN, STOCHASTIC, check_seed
from mixprec.numerics.fp8.recipes import (
    BACKWARD_FORMAT,
    FORWARD_FORMAT,
    FP8_RECIPES,
    MX_BLOCK,
    ROLE_FORMATS,
    ROLES,
    FP8Recipe,
)
from mixprec.numerics.fp8.scaling import DelayedScaling
from mixprec.numerics.fp8.stats import FP8Statistics
from mixprec.numerics.guard import NORM_LIMIT, RepeatedSkipWarning, StepGuard, user_stacklevel
from mixprec.numerics.loss_scale import DynamicScale, LossScaleConfig, NoScale, StaticScale
from mixprec.numerics.lowbit import (
    LOWBIT_FORMATS,
    SIGNED_KEYS,
    UNSIGNED_KEYS,
    StateFormat,
    StateMap,
    lowbit_format,
    parse_state_format,
    state_bytes,
    state_map,
)
from mixprec.numerics.masters import MasterWeights
from mixprec.numerics.stages import Stage, StepTracker
from mixprec.numerics.traced_scale import ScaleState, check_traceable, initial_scale, next_scale
from mixprec.policy.grammar import format_loss_scale
from mixprec.policy.lint import check_adam_eps, check_scaler_without_masters
from mixprec.policy.ops import OP_FAMILIES
from mixprec.policy.precedence import module_rule
from mixprec.policy.value import OpRules, Policy

__all__ = [  # noqa: RUF022 (grouped as the docstring lists them)
    # policy and resolution
    "BFLOAT16",
    "FLOAT16",
    "FLOAT32",
    "OP_FAMILIES",
    "DynamicScale",
    "LossScaleConfig",
    "NoScale",
    "OpRules",
    "Policy",
    "StaticScale",
    "canonical_dtype",
    "check_adam_eps",
    "check_rules_visible",
    "check_scaler_without_masters",
    "format_info",
    "format_loss_scale",
    "get_policy",
    "is_floating",
    "is_low_precision",
    "module_rule",
    "resolve_for_device",
    "unseen_notes",
    "widest",
    # step machinery
    "NORM_LIMIT",
    "LossScaler",
    "MasterWeights",
    "MixprecState",
    "RepeatedSkipWarning",
    "ScaleState",
    "ScalerCounters",
    "Stage",
    "StepGuard",
    "StepTracker",
    "check_traceable",
    "initial_scale",
    "next_scale",
    "user_stacklevel",
    # compensated and FP8
    "BACKWARD_FORMAT",
    "FORWARD_FORMAT",
    "FP8_RECIPES",
    "KAHAN",
    "MX_BLOCK",
    "ROLES",
    "ROLE_FORMATS",
    "STOCHASTIC",
    "DelayedScaling",
    "FP8Recipe",
    "FP8Statistics",
    "check_seed",
    # low-bit optimizer state
    "LOWBIT_FORMATS",
    "SIGNED_KEYS",
    "UNSIGNED_KEYS",
    "StateFormat",
    "StateMap",
    "lowbit_format",
    "parse_state_format",
    "state_bytes",
    "state_map",
    # reports
    "RSS_MEASURE",
    "AdviceError",
    "AdviceReport",
    "ModuleDtypes",
    "ModuleSensitivity",
    "OverflowRecord",
    "dtype_rows",
    "format_dtype_report",
    "run_advice",
    "underflow_threshold",
    # plugin plumbing
    "BackendInfo",
    "Capabilities",
    "DeviceCapability",
    "NativeDtypes",
    "UnseenOp",
    "hookimpl",
    "lazy_exports",
    "list_backends",
    "load_backend",
    # atomic writes
    "atomic_path",
    "atomic_write_bytes",
    "atomic_write_text",
]
