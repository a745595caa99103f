"""Presets and aliases, :func:`get_policy` with role overrides, and :func:`resolve_auto`.

=========  =========  =================  =======  =======  ==============  ===========
preset     param      compute            output   master   BatchNorm       loss scale
=========  =========  =================  =======  =======  ==============  ===========
O0         float32    float32            float32  —        (float32)       none
O1         float32    lowp by op rules   float32  —        float32 (rule)  dynamic*
O2         lowp       lowp, passthrough  float32  float32  float32 (rule)  dynamic*
O3         lowp       lowp, passthrough  lowp     —        lowp            none
auto       float32    "auto" (O1 lists)  float32  —        float32 (rule)  decided
=========  =========  =================  =======  =======  ==============  ===========

``O1``…``O3`` compute in float16 and ``O1-bf16``…``O3-bf16`` in bfloat16. (*) dynamic for
float16, none for bfloat16. Aliases: ``32`` → O0, ``16-mixed`` → O1, ``bf16-mixed`` →
O1-bf16, ``16-true`` → O3, ``bf16-true`` → O3-bf16. Gradients are reduced in float32 except
under O3. Names are case-insensitive. Strings, dicts and TOML are read by :mod:`mixprec.spec`.

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
import os
import warnings
from collections.abc import Mapping
from typing import Any

from mixprec.dtypes import BFLOAT16, FLOAT16, FLOAT32, canonical_dtype, is_low_precision
from mixprec.errors import MixprecWarning, PolicyError
from mixprec.grammar import loss_scale_from_value
from mixprec.loss_scale import DynamicScale, NoScale
from mixprec.ops import default_op_rules, passthrough_op_rules
from mixprec.policy import LossScaleConfig, ModuleRule, Policy

__all__ = [
    "ALIASES",
    "BUILTIN_PRESETS",
    "DTYPE_ROLES",
    "ROLE_FIELDS",
    "builtin_preset_names",
    "default_loss_scale",
    "derive",
    "get_policy",
    "load_toml",
    "preset",
    "preset_name_of",
    "preset_names",
    "resolve_auto",
]

#: Built-in presets, in the order they are listed and tried as a base for ``str()``.
BUILTIN_PRESETS: tuple[str, ...] = ("O0", "O1", "O2", "O3", "O1-bf16", "O2-bf16", "O3-bf16", "auto")
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
DTYPE_ROLES: tuple[str, ...] = ("param", "compute", "output", "master", "reduce")
#: Every role field a spec or an override may set (``params`` is accepted for ``param``).
ROLE_FIELDS: tuple[str, ...] = (*DTYPE_ROLES, "loss_scale")
_BATCHNORM = ModuleRule("class", "*BatchNorm*", FLOAT32)


def default_loss_scale(compute: str, param: str, master: str | None) -> LossScaleConfig:
    """Dynamic scaling when float16 compute updates float32 weights; no scaling otherwise."""
    if compute == FLOAT16 and (param == FLOAT32 or master is not None):
        return DynamicScale()
    return NoScale()


def _build(level: str, lowp: str) -> Policy:
    ops = passthrough_op_rules(lowp)
    modules: tuple[ModuleRule, ...]
    if level == "O0":  # nothing runs in low precision, so nothing needs banning either
        ops = passthrough_op_rules(FLOAT32)
        return Policy(FLOAT32, FLOAT32, FLOAT32, None, FLOAT32, NoScale(), ops, ())
    if level == "O1":
        param, output, master, modules = FLOAT32, FLOAT32, None, (_BATCHNORM,)
        ops = default_op_rules(lowp)
    elif level == "O2":
        param, output, master, modules = lowp, FLOAT32, FLOAT32, (_BATCHNORM,)
    else:
        param, output, master, modules = lowp, lowp, None, ()
    reduce = lowp if level == "O3" else FLOAT32
    scale = default_loss_scale(lowp, param, master)
    return Policy(param, lowp, output, master, reduce, scale, ops, modules)


@functools.cache
def _builtin(name: str) -> Policy:
    canonical = ALIASES.get(name, name)
    if canonical == "auto":
        # O1's float16 lists: the conservative ones until the device picks the dtype
        policy = dataclasses.replace(_build("O1", FLOAT16), compute="auto", loss_scale=NoScale())
    else:
        level, _, suffix = canonical.partition("-")
        policy = _build(level, BFLOAT16 if suffix else FLOAT16)
    return dataclasses.replace(policy, name=name)


def _plugin_presets() -> dict[str, Any]:
    from mixprec.plugins import plugin_presets  # loads the plugins: only when a name needs it

    return plugin_presets()


def builtin_preset_names() -> list[str]:
    """Built-in presets, then their aliases (without looking at plugins)."""
    return [*BUILTIN_PRESETS, *ALIASES]


def preset_names() -> list[str]:
    """Built-in presets, their aliases, then presets contributed by plugins."""
    builtin = builtin_preset_names()
    return builtin + sorted(set(_plugin_presets()) - set(builtin))


def preset(name: str) -> Policy:
    """The preset (or alias, or plugin preset) called ``name``.

    :raises PolicyError: no such preset; the message gives the close matches and every name.
    """
    builtin = _BY_LOWER.get(name.strip().lower())
    if builtin is not None:
        return _builtin(builtin)
    plugins = _plugin_presets()
    if name in plugins:
        found = plugins[name]
        if not isinstance(found, Policy):
            from mixprec.spec import policy_from_mapping

            found = policy_from_mapping(found)
        return dataclasses.replace(found, name=name)
    names = preset_names()
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise PolicyError(
        f"unknown policy preset {name!r}.{hint} Valid presets: {', '.join(names)}. Or write a "
        "key-grammar spec such as 'base=O1,compute=bfloat16', or the path of a .toml file."
    )


def preset_name_of(policy: Policy) -> str | None:
    """The built-in preset equal to ``policy`` (its own name first), or None."""
    own = _BY_LOWER.get((policy.name or "").lower())
    if own is not None and _builtin(own) == policy:
        return own
    return next((name for name in BUILTIN_PRESETS if _builtin(name) == policy), None)


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


def _follow_compute(base: Policy, compute: object) -> dict[str, Any]:
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


def derive(base: Policy, overrides: Mapping[str, Any]) -> Policy:
    """``base`` with role fields replaced, re-deriving defaults as the module docstring says."""
    given = _overrides(overrides)
    if not given:
        return base
    fields: dict[str, Any] = {f: getattr(base, f) for f in (*ROLE_FIELDS, "ops", "modules")}
    if "compute" in given:
        fields.update(_follow_compute(base, given["compute"]))
    fields.update(
        (role, given[role]) for role in ("param", "output", "master", "reduce") if role in given
    )
    if "loss_scale" in given:
        return Policy(**{**fields, "loss_scale": loss_scale_from_value(given["loss_scale"])})
    policy = Policy(**fields)
    if base.loss_scale != default_loss_scale(base.compute, base.param, base.master):
        return policy  # a loss scale someone chose: keep it
    scale = default_loss_scale(policy.compute, policy.param, policy.master)
    return policy if scale == policy.loss_scale else dataclasses.replace(policy, loss_scale=scale)


def get_policy(
    spec: str | os.PathLike[str] | Policy | Mapping[str, Any] | None = "auto", **overrides: Any
) -> Policy:
    """The policy ``spec`` names, with role ``overrides`` applied.

    :param spec: a preset or alias (``"O2"``, ``"bf16-mixed"``), a key-grammar string
        (``"base=O1,compute=bfloat16,fp32+=matmul"``), the path of a ``.toml`` file, a
        :class:`Policy`, or a mapping in :meth:`Policy.to_dict` form (partial ones build on
        ``"base"``). None means ``"auto"``.
    :param overrides: ``param`` (or ``params``), ``compute``, ``output``, ``master``,
        ``reduce``, ``loss_scale``; see the module docstring for what a changed compute
        re-derives.
    :raises PolicyError: an unknown preset, key, dtype or op, or a contradictory policy.
    """
    if spec is None:
        spec = "auto"
    if isinstance(spec, Policy):
        policy = spec
    elif isinstance(spec, str) and not any(mark in spec for mark in ("=", ",", ".toml")):
        policy = preset(spec)
    else:
        from mixprec.spec import policy_from_spec

        policy = policy_from_spec(spec)
    return derive(policy, overrides) if overrides else policy


def load_toml(path_or_text: str | os.PathLike[str]) -> Policy:
    """A policy from a TOML file or TOML text (keys as in :meth:`Policy.from_dict`)."""
    from mixprec.spec import read_toml

    return read_toml(path_or_text)


def resolve_auto(policy: Policy, preferred_lowp: str | None) -> Policy:
    """Turn an ``auto`` policy into a concrete one for a device.

    :param preferred_lowp: the low-precision dtype the device runs fast (from
        :meth:`mixprec.Capabilities.preferred_lowp`), or None when there is none.
    :returns: ``policy`` unchanged when it is already resolved; else ``policy`` with that
        compute dtype (``auto`` itself becomes exactly ``O1`` or ``O1-bf16``), or ``O0`` with
        one :class:`~mixprec.MixprecWarning` when ``preferred_lowp`` is None.
    """
    if policy.is_resolved:
        return policy
    if preferred_lowp is None:
        warnings.warn(
            "policy 'auto': this device has no fast float16/bfloat16 compute, so training runs "
            "in float32 (O0). Pass policy='O1-bf16' or 'O1' to force mixed precision anyway.",
            MixprecWarning,
            stacklevel=2,
        )
        return _builtin("O0")
    lowp = canonical_dtype(preferred_lowp)
    if not is_low_precision(lowp):
        raise PolicyError(
            f"resolve_auto needs a low-precision dtype ('bfloat16' or 'float16') or None, "
            f"got {preferred_lowp!r}"
        )
    resolved = derive(policy, {"compute": lowp})
    name = preset_name_of(resolved)
    return dataclasses.replace(resolved, name=name) if name else resolved
