"""The built-in preset catalog: presets, aliases, default op lists, overrides, auto.

=========  =========  =================  =======  =======  ==============  ===========
preset     param      compute            output   master   BatchNorm       loss scale
=========  =========  =================  =======  =======  ==============  ===========
O0         float32    float32            float32  —        (float32)       none
O1         float32    lowp by op rules   float32  —        float32 (rule)  dynamic*
O2         lowp       lowp, passthrough  float32  float32  float32 (rule)  dynamic*
O3         lowp       lowp, passthrough  lowp     —        lowp            none
O3-bf16-*  bfloat16   bfloat16, passthr. bfloat16 kahan/sr lowp            none
auto       float32    "auto" (O1 lists)  float32  —        float32 (rule)  decided
=========  =========  =================  =======  =======  ==============  ===========

``O1``…``O3`` compute in float16 and ``O1-bf16``…``O3-bf16`` in bfloat16. (*) dynamic for
float16, none for bfloat16. ``O3-bf16-kahan`` and ``O3-bf16-sr`` are O3-bf16 with the
compensated master-weight strategies ``master=kahan`` and ``master=stochastic``
(:mod:`mixprec.numerics.compensated`); ``O1-fp8`` and ``O2-fp8`` are O1-bf16 and O2-bf16 with
``fp8=tensorwise``: their ``linear`` layers run as FP8 GEMMs (:mod:`mixprec.numerics.fp8.recipes`).
Aliases: ``32`` → O0, ``16-mixed`` → O1, ``bf16-mixed`` → O1-bf16, ``16-true`` → O3,
``bf16-true`` → O3-bf16. Gradients are reduced in float32 except under O3. Names are
case-insensitive. This module knows the built-in presets only; the front door
:mod:`mixprec.engine.spec` adds plugin presets, strings, dicts and TOML
(:func:`mixprec.get_policy`).

**Below the policy.** The catalog is data and functions *over* policies: it sits under
:mod:`mixprec.policy.value` in the core's floors and never imports it, so that ``str(policy)``
(:mod:`mixprec.policy.forms`) can look presets up without an import circle. A preset is its
fields (:func:`preset_fields`); the functions take and return any policy value through the
:class:`PolicyFields` protocol, building new ones with :func:`dataclasses.replace` (so the
policy's own validation runs), and :func:`mixprec.policy.value.builtin_preset` holds the preset
:class:`~mixprec.policy.value.Policy` objects themselves.

**Overrides and a changed compute dtype.** ``get_policy("O2", compute="bfloat16")`` and the
key ``compute=`` re-derive the fields that still hold the value the old compute dtype gave
them, and keep every field you set: ``param``, ``output`` and ``reduce`` follow compute when
they equalled the old low-precision compute; the op lists are replaced by the new compute's
defaults only if they equal the old compute's defaults exactly (O1-style lists or
passthrough-only lists); an edited op list is kept as it is. Whenever ``loss_scale`` is not
given, a loss scale that was the default (dynamic when float16 compute updates float32
weights, that is float32 params or float32 masters; none otherwise) is re-derived for the
new settings. So ``get_policy("O2-bf16", compute="float16") == get_policy("O2")``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, TypeVar

from mixprec.dtypes import (
    BFLOAT16,
    FLOAT16,
    FLOAT32,
    canonical_dtype,
    format_info,
    is_low_precision,
)
from mixprec.errors import MixprecWarning, PolicyError
from mixprec.numerics.compensated import KAHAN, STOCHASTIC
from mixprec.numerics.fp8.recipes import FP8Recipe
from mixprec.numerics.loss_scale import DynamicScale, LossScaleConfig, NoScale
from mixprec.policy.ops import (
    DEFAULT_BANNED,
    DEFAULT_FP32,
    DEFAULT_LOWP,
    DEFAULT_PASSTHROUGH,
    DEFAULT_PROMOTE,
    FP16_RANGE_ONLY,
    OP_FAMILIES,
)
from mixprec.policy.rules import ModuleRule, OpRules

__all__ = [
    "ALIASES",
    "BUILTIN_PRESETS",
    "DTYPE_ROLES",
    "ROLE_FIELDS",
    "PolicyFields",
    "builtin_preset_name",
    "builtin_preset_names",
    "default_loss_scale",
    "default_op_rules",
    "derive",
    "passthrough_op_rules",
    "preset_fields",
    "preset_like",
    "preset_name_of",
    "resolve_auto",
]


class PolicyFields(Protocol):
    """What the catalog reads of a policy: :class:`mixprec.policy.value.Policy` is the one there is.

    A frozen dataclass with these fields; new policies are made from one with
    :func:`dataclasses.replace`, so its own validation runs.
    """

    __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def param(self) -> str: ...
    @property
    def compute(self) -> str: ...
    @property
    def output(self) -> str: ...
    @property
    def master(self) -> str | None: ...
    @property
    def reduce(self) -> str: ...
    @property
    def state(self) -> str | None: ...
    @property
    def fp8(self) -> FP8Recipe | None: ...
    @property
    def loss_scale(self) -> LossScaleConfig: ...
    @property
    def ops(self) -> OpRules: ...
    @property
    def modules(self) -> tuple[ModuleRule, ...]: ...
    @property
    def name(self) -> str | None: ...
    @property
    def is_resolved(self) -> bool: ...


P = TypeVar("P", bound=PolicyFields)

#: Built-in presets, in the order they are listed and tried as a base for ``str()``.
BUILTIN_PRESETS: tuple[str, ...] = (
    "O0",
    "O1",
    "O2",
    "O3",
    "O1-bf16",
    "O2-bf16",
    "O3-bf16",
    "O3-bf16-kahan",
    "O3-bf16-sr",
    "O1-fp8",
    "O2-fp8",
    "auto",
)
#: The compensated presets: O3-bf16 with a master-weight strategy
#: (:mod:`mixprec.numerics.compensated`).
_STRATEGY_PRESETS: dict[str, str] = {"O3-bf16-kahan": KAHAN, "O3-bf16-sr": STOCHASTIC}
#: The FP8 presets: O1-bf16 / O2-bf16 with ``fp8=tensorwise`` (:mod:`mixprec.numerics.fp8.recipes`).
_FP8_PRESETS: dict[str, str] = {"O1-fp8": "O1-bf16", "O2-fp8": "O2-bf16"}
#: Lightning-style aliases of built-in presets.
ALIASES: dict[str, str] = {
    "32": "O0",
    "16-mixed": "O1",
    "bf16-mixed": "O1-bf16",
    "16-true": "O3",
    "bf16-true": "O3-bf16",
}
_BY_LOWER = {name.lower(): name for name in (*BUILTIN_PRESETS, *ALIASES)}
#: The roles that name a dtype, in the order they are printed.
DTYPE_ROLES: tuple[str, ...] = ("param", "compute", "output", "master", "reduce", "state")
#: Every role field a spec or an override may set (``params`` is accepted for ``param``).
ROLE_FIELDS: tuple[str, ...] = (*DTYPE_ROLES, "loss_scale", "fp8")
_BATCHNORM = ModuleRule("class", "*BatchNorm*", FLOAT32)


def default_loss_scale(compute: str, param: str, master: str | None) -> LossScaleConfig:
    """Dynamic scaling when float16 compute updates float32 weights; no scaling otherwise."""
    if compute == FLOAT16 and (param == FLOAT32 or master is not None):
        return DynamicScale()
    return NoScale()


def _has_fp16_range(compute: str) -> bool:
    # "auto" may resolve to float16, so it gets float16's conservative lists
    return (
        compute == "auto"
        or format_info(compute).exponent_bits <= format_info(FLOAT16).exponent_bits
    )


@functools.lru_cache(maxsize=16)
def default_op_rules(compute: str) -> OpRules:
    """The op lists an op-casting (O1-style) policy uses for ``compute``.

    For float16 (and the float8 formats, and ``"auto"``, which may become float16) this is
    the lists in :data:`DEFAULT_LOWP` … :data:`DEFAULT_PASSTHROUGH`, with
    ``binary_cross_entropy`` banned. For formats with float32's exponent range (bfloat16,
    float32) ``pow`` and ``prod`` pass through and ``binary_cross_entropy`` runs in float32
    like the other losses.
    """
    compute = compute if compute == "auto" else canonical_dtype(compute)
    if _has_fp16_range(compute):
        return OpRules(
            lowp=DEFAULT_LOWP,
            fp32=DEFAULT_FP32,
            promote=DEFAULT_PROMOTE,
            passthrough=DEFAULT_PASSTHROUGH,
            banned=DEFAULT_BANNED,
        )
    return OpRules(
        lowp=DEFAULT_LOWP,
        fp32=[op for op in DEFAULT_FP32 if op not in FP16_RANGE_ONLY] + list(DEFAULT_BANNED),
        promote=DEFAULT_PROMOTE,
        passthrough=[*DEFAULT_PASSTHROUGH, *FP16_RANGE_ONLY],
        banned=(),
    )


@functools.lru_cache(maxsize=16)
def passthrough_op_rules(compute: str) -> OpRules:
    """The op lists of a policy that casts at model and module boundaries only (O0, O2, O3).

    Every family passes through except the ones :func:`default_op_rules` bans for
    ``compute``, which stay banned.
    """
    banned = default_op_rules(compute).banned
    return OpRules(passthrough=[op for op in OP_FAMILIES if op not in banned], banned=banned)


def _fields(
    param: str,
    compute: str,
    output: str,
    master: str | None,
    reduce: str,
    loss_scale: LossScaleConfig,
    ops: OpRules,
    modules: tuple[ModuleRule, ...],
) -> dict[str, Any]:
    return dict(
        param=param, compute=compute, output=output, master=master, reduce=reduce,
        state=None, loss_scale=loss_scale, ops=ops, modules=modules, fp8=None,
    )  # fmt: skip


def _build(level: str, lowp: str) -> dict[str, Any]:
    ops = passthrough_op_rules(lowp)
    modules: tuple[ModuleRule, ...]
    if level == "O0":  # nothing runs in low precision, so nothing needs banning either
        ops = passthrough_op_rules(FLOAT32)
        return _fields(FLOAT32, FLOAT32, FLOAT32, None, FLOAT32, NoScale(), ops, ())
    if level == "O1":
        param, output, master, modules = FLOAT32, FLOAT32, None, (_BATCHNORM,)
        ops = default_op_rules(lowp)
    elif level == "O2":
        param, output, master, modules = lowp, FLOAT32, FLOAT32, (_BATCHNORM,)
    else:
        param, output, master, modules = lowp, lowp, None, ()
    reduce = lowp if level == "O3" else FLOAT32
    scale = default_loss_scale(lowp, param, master)
    return _fields(param, lowp, output, master, reduce, scale, ops, modules)


@functools.cache
def _preset_fields(canonical: str) -> dict[str, Any]:
    if canonical in _STRATEGY_PRESETS:
        return {**_build("O3", BFLOAT16), "master": _STRATEGY_PRESETS[canonical]}
    if canonical in _FP8_PRESETS:
        base = _preset_fields(_FP8_PRESETS[canonical])
        return {**base, "fp8": FP8Recipe("tensorwise")}
    if canonical == "auto":
        # O1's float16 lists: the conservative ones until the device picks the dtype
        return {**_build("O1", FLOAT16), "compute": "auto", "loss_scale": NoScale()}
    level, _, suffix = canonical.partition("-")
    return _build(level, BFLOAT16 if suffix else FLOAT16)


def builtin_preset_names() -> list[str]:
    """Built-in presets, then their aliases (without looking at plugins)."""
    return [*BUILTIN_PRESETS, *ALIASES]


def builtin_preset_name(name: str) -> str | None:
    """``name`` as the catalog spells it (any case in, ``"O2-bf16"`` out), or None when it
    is no built-in preset or alias."""
    return _BY_LOWER.get(name.strip().lower())


def preset_fields(name: str) -> dict[str, Any]:
    """The policy fields of the built-in preset or alias ``name`` (spelled as the catalog
    does: see :func:`builtin_preset_name`), ``name`` itself left out.

    :raises KeyError: ``name`` is not a built-in preset or alias.
    """
    return dict(_preset_fields(ALIASES.get(name, name)))


def _made_like(policy: P, fields: Mapping[str, Any], name: str | None) -> P:
    """A policy of ``policy``'s class with exactly ``fields`` (the others at their defaults)."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(policy):
        if not f.init:
            continue
        if f.name in fields:
            values[f.name] = fields[f.name]
        elif f.default is not dataclasses.MISSING:
            values[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            values[f.name] = f.default_factory()
    values["name"] = name
    return dataclasses.replace(policy, **values)


_LIKE: dict[tuple[type, str], Any] = {}


def preset_like(policy: P, name: str) -> P:
    """The built-in preset ``name`` (catalog spelling) as a policy of ``policy``'s class.

    Cached per class and name: a race may build one twice, never a different one.
    """
    key = (type(policy), name)
    found = _LIKE.get(key)
    if found is None:
        found = _LIKE[key] = _made_like(policy, preset_fields(name), name)
    return found  # type: ignore[no-any-return]


def preset_name_of(policy: PolicyFields) -> str | None:
    """The built-in preset equal to ``policy`` (its own name first), or None."""
    own = _BY_LOWER.get((policy.name or "").lower())
    if own is not None and preset_like(policy, own) == policy:
        return own
    return next((name for name in BUILTIN_PRESETS if preset_like(policy, name) == policy), None)


def _overrides(given: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in given.items():
        role = "param" if key == "params" else key
        if role not in ROLE_FIELDS:
            close = difflib.get_close_matches(key, [*ROLE_FIELDS, "params"], n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise PolicyError(
                f"unknown policy field {key!r}.{hint} Valid fields: {', '.join(ROLE_FIELDS)} "
                "('params' is accepted for 'param')"
            )
        if role in out:
            raise PolicyError("give 'param' or 'params', not both")
        out[role] = value
    return out


def _follow_compute(base: PolicyFields, compute: object) -> dict[str, Any]:
    """The fields a change of compute dtype sets (see the module docstring)."""
    new = "auto" if str(compute).lower() == "auto" else canonical_dtype(compute)
    old = base.compute
    changed: dict[str, Any] = {"compute": new}
    if new == old:
        return changed
    if new != "auto" and old != "auto" and is_low_precision(old):
        roles = ("param", "output", "reduce")
        changed.update((role, new) for role in roles if getattr(base, role) == old)
    for lists in (default_op_rules, passthrough_op_rules):
        if base.ops == lists(old):
            changed["ops"] = lists(new)
            break
    return changed


def derive(base: P, overrides: Mapping[str, Any]) -> P:
    """``base`` with role fields replaced, re-deriving defaults as the module docstring says.

    A ``loss_scale`` override is a loss-scale object here; :func:`mixprec.get_policy` and
    the mappings read every other form through :func:`mixprec.policy.forms.parsed_roles`.
    """
    given = _overrides(overrides)
    if not given:
        return base
    fields: dict[str, Any] = {f: getattr(base, f) for f in (*ROLE_FIELDS, "ops", "modules")}
    if "compute" in given:
        fields.update(_follow_compute(base, given["compute"]))
    fields.update(
        (role, given[role])
        for role in ("param", "output", "master", "reduce", "state", "fp8")
        if role in given
    )
    if "loss_scale" in given:
        fields["loss_scale"] = given["loss_scale"]
        return dataclasses.replace(base, **fields, name=None)
    policy = dataclasses.replace(base, **fields, name=None)
    if base.loss_scale != default_loss_scale(base.compute, base.param, base.master):
        return policy  # a loss scale someone chose: keep it
    scale = default_loss_scale(policy.compute, policy.param, policy.master)
    return policy if scale == policy.loss_scale else dataclasses.replace(policy, loss_scale=scale)


def resolve_auto(policy: P, preferred_lowp: str | None, why: str = "") -> P:
    """Turn an ``auto`` policy into a concrete one for a device.

    :param preferred_lowp: the low-precision dtype the device runs fast (from
        :meth:`mixprec.Capabilities.preferred_lowp`), or None when there is none.
    :param why: the device's hardware facts (:attr:`mixprec.DeviceCapability.note`), quoted
        in the float32 warning so that it names what the device lacks.
    :returns: ``policy`` unchanged when it is already resolved; else ``policy`` with that
        compute dtype (``auto`` itself becomes exactly ``O1`` or ``O1-bf16``), or ``O0`` with
        one :class:`~mixprec.MixprecWarning` when ``preferred_lowp`` is None.
    """
    if policy.is_resolved:
        return policy
    if preferred_lowp is None:
        reason = f" ({why})" if why else ""
        warnings.warn(
            f"policy 'auto': this device has no fast float16/bfloat16 compute{reason}, so "
            "training runs in float32 (O0). Pass policy='O1-bf16' or 'O1' to force mixed "
            "precision anyway.",
            MixprecWarning,
            stacklevel=2,
        )
        return preset_like(policy, "O0")
    lowp = canonical_dtype(preferred_lowp)
    if not is_low_precision(lowp):
        raise PolicyError(
            f"resolve_auto needs a low-precision dtype ('bfloat16' or 'float16') or None, "
            f"got {preferred_lowp!r}"
        )
    resolved = derive(policy, {"compute": lowp})
    name = preset_name_of(resolved)
    return dataclasses.replace(resolved, name=name) if name else resolved
