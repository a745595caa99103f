"""The backends under test and the cases each conformance test runs for them.

Pure mixprec, no pytest: :func:`build_backend` (the only place a framework gets imported)
turns a backend name into a :class:`BackendUnderTest`, or records why it could not be
built. The ``*_cases`` functions list, for one backend, the parameters of one test of
:mod:`mixprec.testing.suite` as ``(id, values)`` pairs. Which cases exist depends only on
what the backend declares (its ops and its device's compute dtypes), never on whether they
pass.
"""

from __future__ import annotations

import dataclasses
import functools
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mixprec.backend import Capabilities, DeviceCapability
from mixprec.dtypes import canonical_dtype
from mixprec.engine.plugins import load_backend
from mixprec.engine.spec import get_policy
from mixprec.numerics.loss_scale import DynamicScale
from mixprec.policy.ops import OP_FAMILIES
from mixprec.testing.xfail import XfailEntry, parse_xfail_file, xfail_file_for

if TYPE_CHECKING:
    from mixprec.policy.value import Policy
    from mixprec.testing.protocol import ConformanceAdapter

__all__ = [
    "FP8_POLICIES",
    "LOWBIT_POLICIES",
    "LOWP_DTYPES",
    "OVERFLOW_SEQUENCE",
    "BackendUnderTest",
    "Case",
    "build_backend",
    "cases",
    "computing_in",
    "policy",
    "trace_scale",
]

Case = tuple[str, tuple[Any, ...]]

LOWP_DTYPES = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")

# Overflow flags fed to the trainer, one per step. With trace_scale() (interval 3,
# hysteresis 2) this covers growth, an overflow tolerated by hysteresis, back-offs, a
# lone finite step that must not refill the tolerance, and growth again.
OVERFLOW_SEQUENCE: tuple[bool, ...] = (
    False, False, False, True, False, False, False,
    True, True, False, True, False, False, False, False, True,
)  # fmt: skip


def trace_scale() -> DynamicScale:
    """The dynamic loss scale the scaler-trace test installs (small init and interval)."""
    return DynamicScale(init=2.0**8, interval=3, hysteresis=2)


# ------------------------------------------------------------------------------------------
# Named policies: presets, and presets with edited op lists
# ------------------------------------------------------------------------------------------

# Edits that move ops across every list, so a backend that hard-codes the default lists
# instead of asking the policy fails.
_EDITS: dict[str, list[str]] = {
    "fp32": ["linear", "matmul", "conv", "bmm"],
    "lowp": ["softmax", "log_softmax", "sum", "layer_norm"],
    "promote": ["relu", "gelu", "cross_entropy"],
    "passthrough": ["add", "mul", "exp"],
}

_TRAINER_PRESETS = ("O0", "O1", "O2", "O3", "O1-bf16", "O2-bf16", "O3-bf16")
_STRATEGY_PRESETS = ("O3-bf16-kahan", "O3-bf16-sr")
_STATE_POLICIES = ("O3-bf16-kahan,state=bfloat16", "O3-bf16-sr,state=bfloat16")
#: A low-bit state (:mod:`mixprec.numerics.lowbit`) under each kind of master strategy: none
#: (float32 params), float32 masters with a dynamic loss scale, and both compensated ones.
#: Blocks of 32 and no size floor, so the suite's small models have short last blocks.
LOWBIT_POLICIES = (
    "O0,state=int8(block=32,min_size=0)",
    "O2,state=int4(block=32,min_size=0)",
    "O3-bf16-kahan,state=fp8(block=32,min_size=0)",
    "O3-bf16-sr,state=int8(block=32,min_size=0)",
)
_OP_POLICIES = (*_TRAINER_PRESETS, "O1+edits", "O1-bf16+edits", "O2+edits")
#: The FP8 policy each recipe trains under, where the device lists the recipe.
FP8_POLICIES: dict[str, str] = {
    "tensorwise": "O1-fp8",
    "rowwise": "O1-fp8,fp8=rowwise",
    "delayed": "O2-fp8,fp8=delayed(history=4)",
    "mxfp8": "O2-fp8,fp8=mxfp8",
}


_VARIANTS = ("edits", "trace")


@functools.cache
def policy(name: str) -> Policy:
    """The policy a case names: anything :func:`mixprec.get_policy` reads, optionally with
    ``+edits`` (op lists moved around) or ``+trace`` (the loss scale replaced by
    :func:`trace_scale`) appended."""
    base, _, variant = name.rpartition("+")
    if variant not in _VARIANTS:
        base, variant = name, ""
    result = get_policy(base)
    if variant == "edits":
        result = result.with_ops(**_EDITS)
    elif variant == "trace":
        result = dataclasses.replace(result, loss_scale=trace_scale())
    return result


def computing_in(dtype: str) -> str:
    """A policy name whose linear layers compute in ``dtype`` (O1-style for low precision)."""
    return "O0" if dtype == "float32" else f"base=O1,compute={dtype}"


# ------------------------------------------------------------------------------------------
# A backend under test
# ------------------------------------------------------------------------------------------


@dataclass
class BackendUnderTest:
    """A backend the suite was pointed at: its adapter and what it declares, or the error
    that kept it from being built."""

    name: str
    adapter: ConformanceAdapter | None = None
    capabilities: Capabilities | None = None
    error: str | None = None
    xfail_file: Path | None = None
    xfails: list[XfailEntry] = field(default_factory=list)
    test_ids: set[str] = field(default_factory=set)
    """Every conformance id generated for this backend (filled in during collection)."""

    def __repr__(self) -> str:  # the object shows up in pytest's failure reports
        return f"<backend {self.name}>"

    @property
    def device(self) -> str:
        """The device the adapter runs on (its optional ``device`` attribute, else cpu)."""
        return str(getattr(self.adapter, "device", "cpu"))

    @property
    def device_capability(self) -> DeviceCapability:
        """The capabilities entry of :attr:`device`."""
        assert self.capabilities is not None
        return self.capabilities.device(self.device)

    @property
    def compute_dtypes(self) -> tuple[str, ...]:
        """Canonical dtypes the device lists as able to compute a linear."""
        return tuple(canonical_dtype(d) for d in self.device_capability.compute_dtypes)

    @property
    def master_strategies(self) -> set[str]:
        """The compensated master-weight strategies the adapter runs (its optional
        ``master_strategies``; none by default)."""
        return set(getattr(self.adapter, "master_strategies", ()))

    @property
    def state_dtypes(self) -> set[str]:
        """The dtypes the adapter keeps optimizer state in between steps under a strategy
        (its optional ``state_dtypes``; none by default)."""
        return set(getattr(self.adapter, "state_dtypes", ()))

    def fp32_islands(self, dtype: str) -> set[str]:
        """Op families the adapter runs as float32 islands where a rule says ``dtype``
        (its optional ``fp32_islands``; none by default)."""
        islands = getattr(self.adapter, "fp32_islands", None)
        return set(islands(dtype)) if islands is not None else set()

    def op_module_class(self, op: str) -> tuple[str, ...] | None:
        """The class names of the module the adapter runs ``op`` in (its optional
        ``op_module_class``), or None for an op it runs as a function."""
        lookup = getattr(self.adapter, "op_module_class", None)
        classes = lookup(op) if lookup is not None else None
        return None if classes is None else tuple(classes)

    def expected_dtype(self, op: str, decided: str) -> str:
        """The dtype ``op`` computes in when the policy decides ``decided``: float32 for an
        island, else ``decided``."""
        return "float32" if op in self.fp32_islands(decided) else decided

    def runs(self, preset: str) -> bool:
        """Whether the device lists the compute dtype of ``preset``."""
        return policy(preset).compute in self.compute_dtypes

    def ops(self) -> list[str]:
        """The neutral op families the adapter maps, sorted."""
        assert self.adapter is not None
        return sorted(self.adapter.supported_ops())

    def xfail_reason(self, test_id: str) -> str | None:
        """The reason ``test_id`` is listed in the xfail file, or None."""
        return next((e.reason for e in self.xfails if e.matches(test_id)), None)


def build_backend(name: str) -> BackendUnderTest:
    """Load backend ``name`` and its adapter; on any error keep the traceback instead."""
    backend = BackendUnderTest(name)
    try:
        api = load_backend(name)
        backend.capabilities = api.capabilities()
        backend.adapter = api.conformance_adapter()
        if backend.adapter.name != name:
            raise ValueError(
                f"conformance_adapter() of backend {name!r} returned an adapter named "
                f"{backend.adapter.name!r}"
            )
        backend.device_capability  # noqa: B018 - raises when the device is not reported
        unknown = set(backend.adapter.supported_ops()) - set(OP_FAMILIES)
        if unknown:
            raise ValueError(
                f"supported_ops() names ops outside mixprec.OP_FAMILIES: {sorted(unknown)}"
            )
        backend.xfail_file = xfail_file_for(backend.adapter)
        if backend.xfail_file is not None and backend.xfail_file.is_file():
            backend.xfails = parse_xfail_file(backend.xfail_file.read_text(encoding="utf-8"))
    except Exception:
        backend.error = traceback.format_exc()
        backend.adapter = None
    return backend


# ------------------------------------------------------------------------------------------
# Cases per test: (id without the backend, parameter values)
# ------------------------------------------------------------------------------------------


def no_cases(backend: BackendUnderTest) -> list[Case]:
    """One case without parameters (tests that run once per backend)."""
    return [("", ())]


def listed_dtype_cases(backend: BackendUnderTest) -> list[Case]:
    """Every dtype the device lists."""
    return [(dtype, (dtype,)) for dtype in backend.compute_dtypes]


def unlisted_dtype_cases(backend: BackendUnderTest) -> list[Case]:
    """Every low-precision dtype the device does not list."""
    return [(d, (d,)) for d in LOWP_DTYPES if d not in backend.compute_dtypes]


def op_cases(backend: BackendUnderTest) -> list[Case]:
    """Every (policy, op) pair whose compute dtype the device lists."""
    return [
        (f"{name}-{op}", (name, op))
        for name in _OP_POLICIES
        if backend.runs(name)
        for op in backend.ops()
    ]


def classic_trainer_cases(backend: BackendUnderTest) -> list[Case]:
    """Every preset without a compensated strategy whose compute dtype the device lists."""
    return [(name, (name,)) for name in _TRAINER_PRESETS if backend.runs(name)]


def strategy_cases(backend: BackendUnderTest) -> list[Case]:
    """The compensated presets (``O3-bf16-kahan``, ``O3-bf16-sr``) whose strategy the
    adapter declares in its optional ``master_strategies`` and whose dtype the device runs."""
    return [
        (name, (name,))
        for name in _STRATEGY_PRESETS
        if backend.runs(name) and policy(name).master_strategy in backend.master_strategies
    ]


def state_cases(backend: BackendUnderTest) -> list[Case]:
    """The compensated presets with ``state=bfloat16`` (the optimizer state rounded
    stochastically into bfloat16 between steps), where the adapter declares the strategy
    in ``master_strategies`` and ``"bfloat16"`` in its optional ``state_dtypes``."""
    return [
        (name, (name,))
        for name in _STATE_POLICIES
        if backend.runs(name)
        and policy(name).master_strategy in backend.master_strategies
        and policy(name).state in backend.state_dtypes
    ]


def refused_state_cases(backend: BackendUnderTest) -> list[Case]:
    """The ``state=bfloat16`` policies of a strategy the adapter runs but whose state dtype
    it does not declare: the backend must refuse them."""
    return [
        (name, (name,))
        for name in _STATE_POLICIES
        if backend.runs(name)
        and policy(name).master_strategy in backend.master_strategies
        and policy(name).state not in backend.state_dtypes
    ]


def _lowbit_runs(backend: BackendUnderTest, name: str) -> bool:
    """Whether the device runs the low-bit policy ``name`` and the adapter its strategy."""
    strategy = policy(name).master_strategy
    return backend.runs(name) and (strategy is None or strategy in backend.master_strategies)


def _lowbit_format(name: str) -> str:
    state = policy(name).state
    assert state is not None
    return state.partition("(")[0]


def lowbit_state_cases(backend: BackendUnderTest) -> list[Case]:
    """The :data:`LOWBIT_POLICIES` whose format the adapter lists in its optional
    ``state_dtypes`` (and whose strategy and dtypes it runs)."""
    return [
        (name, (name,))
        for name in LOWBIT_POLICIES
        if _lowbit_runs(backend, name) and _lowbit_format(name) in backend.state_dtypes
    ]


def refused_lowbit_cases(backend: BackendUnderTest) -> list[Case]:
    """The :data:`LOWBIT_POLICIES` the backend runs but whose format its adapter does not
    list in ``state_dtypes``: the backend must refuse them."""
    return [
        (name, (name,))
        for name in LOWBIT_POLICIES
        if _lowbit_runs(backend, name) and _lowbit_format(name) not in backend.state_dtypes
    ]


def trainer_cases(backend: BackendUnderTest) -> list[Case]:
    """Every preset the backend trains: the classic ones, then the compensated ones (with
    the optimizer's own state, then with bfloat16 state), then those with a low-bit state,
    then the FP8 ones (:func:`mixprec.testing.fp8.fp8_trainer_cases`)."""
    classic = classic_trainer_cases(backend) + strategy_cases(backend) + state_cases(backend)
    return classic + lowbit_state_cases(backend) + fp8_trainer_cases(backend)


def fp8_trainer_cases(backend: BackendUnderTest) -> list[Case]:
    """The FP8 policy of each recipe the device lists (``DeviceCapability.fp8_recipes``)."""
    listed = getattr(backend.device_capability, "fp8_recipes", ())
    return [
        (name, (name,))
        for recipe, name in FP8_POLICIES.items()
        if recipe in listed and backend.runs(name)
    ]


def trace_cases(backend: BackendUnderTest) -> list[Case]:
    """Presets with float32 masters or params under the trace's dynamic scale, and O0 as
    it is (no scaling: an overflow still skips)."""
    names = [f"{p}+trace" for p in ("O1", "O2", "O1-bf16", "O2-bf16")]
    return [(n, (n,)) for n in ["O0", *names] if backend.runs(n)]


def unseen_op_cases(backend: BackendUnderTest) -> list[Case]:
    """The op families the backend declares it cannot see (``capabilities().unseen_ops``)
    but the framework has: a casting rule on them must be refused."""
    assert backend.capabilities is not None
    return [
        (entry.op, (entry.op,))
        for entry in backend.capabilities.unseen_ops
        if entry.native != "absent"
    ]


def saved_dtype_cases(backend: BackendUnderTest) -> list[Case]:
    """Presets whose checkpoints hold float32 values (masters, weight + compensation, or
    float32 params)."""
    return [
        case
        for case in trainer_cases(backend)
        if policy(case[0]).uses_masters
        or policy(case[0]).master_strategy is not None
        or policy(case[0]).param == "float32"
    ]


def cases(
    generate: Callable[[BackendUnderTest], Iterable[Case]], argnames: tuple[str, ...] = ()
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Mark a suite test with how its cases are generated (read by the pytest plugin)."""

    def mark(test: Callable[..., None]) -> Callable[..., None]:
        test.mixprec_cases = (argnames, generate)  # type: ignore[attr-defined]
        return test

    return mark
