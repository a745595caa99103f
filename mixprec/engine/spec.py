"""The front door for policies: names, the key grammar, mappings, TOML, device resolution.

:func:`get_policy` reads every form a user may give (a built-in or plugin preset, a
key-grammar string, a mapping, a ``.toml`` path); :func:`resolve_for_device` is the one
place a backend turns a spec into the concrete policy it runs on a device (``auto``
resolved from its capabilities, the ``mixprec_policy_resolved`` hook fired).

The key grammar is comma-separated ``key=value`` items (jmp-style)::

    base=O1,compute=bfloat16,fp32+=matmul|bmm,class:*LayerNorm*=float32

Items apply in three phases, whatever order they are written in:

1. ``base`` (or a bare preset name as the first item) picks the starting preset, ``auto``
   if absent;
2. the role fields ``param``/``params``, ``compute``, ``output``, ``master`` (``none``
   for no masters), ``reduce``, ``state`` (``bfloat16`` keeps the optimizer state in
   bfloat16 under a compensated master) and ``loss_scale`` apply together, as
   :func:`mixprec.policy.presets.derive` does (it says what a changed compute re-derives);
3. op and module edits apply in the order written: ``fp32+=softmax|exp`` moves ops into a
   list, ``fp32=softmax|exp`` sets the list to exactly those ops;
   ``class:<glob>=...``/``path:<glob>=...`` adds a module rule or replaces the one for that
   pattern, and ``modules=none`` drops every rule.

Module rule values and loss scales are described in :mod:`mixprec.policy.grammar`.
``str(policy)`` writes the preset name when the policy equals a built-in preset, else the
shortest spec relative to a built-in base (:func:`mixprec.policy.forms.format_policy`);
``get_policy(str(p)) == p`` always.

Mappings (and so TOML files) use the keys of :func:`policy_from_mapping`.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from mixprec.backend import Capabilities
from mixprec.engine.plugins import plugin_presets, policy_resolved
from mixprec.errors import PolicyError, UnsupportedDtypeError
from mixprec.policy.forms import ROLE_KEYS, format_policy, parsed_roles
from mixprec.policy.forms import policy_from_mapping as _from_mapping
from mixprec.policy.grammar import parse_module_rule, split_items, split_ops
from mixprec.policy.presets import ROLE_FIELDS, builtin_preset_names, derive, resolve_auto
from mixprec.policy.rules import LIST_NAMES, list_name, with_rule
from mixprec.policy.value import ModuleRule, Policy, builtin_preset

__all__ = [
    "PolicySpec",
    "format_policy",
    "get_policy",
    "load_toml",
    "parse_spec",
    "policy_from_mapping",
    "policy_from_spec",
    "policy_to_toml",
    "preset",
    "preset_names",
    "read_toml",
    "resolve_for_device",
]

PolicySpec = str | os.PathLike[str] | Policy | Mapping[str, Any] | None
"""Everything :func:`get_policy` accepts."""

_KEYS = (
    "base",
    *ROLE_KEYS,
    *LIST_NAMES,
    *(f"{n}+" for n in LIST_NAMES),
    "modules",
    "class:<glob>",
    "path:<glob>",
)


def _unknown_key(key: str, text: str) -> PolicyError:
    close = difflib.get_close_matches(key, _KEYS, n=2, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return PolicyError(
        f"unknown key {key!r} in policy spec {text!r}.{hint} Valid keys: base, "
        f"{', '.join(ROLE_FIELDS)} (params for param), the op lists {', '.join(LIST_NAMES)} "
        "(with '=' to set a list or '+=' to move ops into it), modules=none, class:<glob>=..., "
        "path:<glob>=..."
    )


def parse_spec(text: str) -> Policy:
    """The policy a key-grammar string describes (see the module docstring)."""
    base: str | None = None
    roles: dict[str, str] = {}
    op_edits: list[tuple[bool, str, list[str]]] = []  # (move?, list, ops)
    module_edits: list[ModuleRule | None] = []  # None: drop all rules
    for position, item in enumerate(split_items(text)):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep:
            if position == 0:
                base = item
                continue
            raise PolicyError(
                f"item {item!r} of policy spec {text!r} is not key=value; only the first item "
                "may be a bare preset name"
            )
        if key == "base" or key in ROLE_KEYS:
            if key in roles or (key == "base" and base is not None):
                raise PolicyError(f"key {key!r} is given twice in policy spec {text!r}")
            if key == "base":
                base = value
            else:
                roles[key] = value
        elif key.endswith("+"):
            op_edits.append((True, list_name(key[:-1].strip()), split_ops(value)))
        elif key in LIST_NAMES:
            op_edits.append((False, key, split_ops(value)))
        elif key == "modules":
            if value.lower() != "none":
                raise PolicyError(
                    f"'modules' takes only the value 'none' (drop every module rule), got "
                    f"{value!r}; add rules with class:<glob>=<dtype> or path:<glob>=<dtype>"
                )
            module_edits.append(None)
        elif key.startswith(("class:", "path:")):
            module_edits.append(parse_module_rule(key, value))
        else:
            raise _unknown_key(key, text)
    if "param" in roles and "params" in roles:
        raise PolicyError(f"give 'param' or 'params' in policy spec {text!r}, not both")
    policy = derive(preset(base or "auto"), parsed_roles(roles))
    ops = policy.ops
    for move, lst, names in op_edits:
        ops = ops.edited(**{lst: names}) if move else ops.replaced(**{lst: names})
    modules = policy.modules
    for rule in module_edits:
        modules = () if rule is None else with_rule(modules, rule)
    return dataclasses.replace(policy, ops=ops, modules=modules, name=None)


def policy_to_toml(policy: Policy) -> str:
    """A complete TOML document for ``policy``: :meth:`Policy.to_toml`."""
    return policy.to_toml()


# ---------------------------------------------------------------------- mappings and TOML


def policy_from_mapping(d: Mapping[str, Any]) -> Policy:
    """A policy from a mapping: the :meth:`Policy.to_dict` form, or a partial one on a
    ``base`` preset, built-in or a plugin's (keys:
    :func:`mixprec.policy.forms.policy_from_mapping`)."""
    return _from_mapping(d, preset)


def read_toml(path_or_text: str | os.PathLike[str]) -> Policy:
    """A policy from a TOML file or TOML text (keys as in :func:`policy_from_mapping`)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            raise PolicyError(
                "reading TOML policies needs Python 3.11+ (tomllib) or `pip install tomli`"
            ) from None
    text = os.fspath(path_or_text)
    if isinstance(path_or_text, os.PathLike) or (
        "\n" not in text and text.strip().endswith(".toml")
    ):
        text = _read_policy_file(text)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise PolicyError(f"policy TOML is not valid TOML: {err}") from err
    except RecursionError:
        raise PolicyError(
            "policy TOML nests arrays or tables too deeply to read; a policy needs two levels"
        ) from None
    return policy_from_mapping(data)


#: The largest policy file read: real ones are a few kilobytes; a path to ``/dev/zero`` or
#: a huge file must not be read without bound.
MAX_POLICY_BYTES = 1 << 20


def _read_policy_file(path: str) -> str:
    """The UTF-8 text of a policy file of at most :data:`MAX_POLICY_BYTES`."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_POLICY_BYTES + 1)
    except OSError as err:
        raise PolicyError(f"cannot read policy file {path!r}: {err}") from err
    if len(data) > MAX_POLICY_BYTES:
        raise PolicyError(
            f"policy file {path!r} is larger than {MAX_POLICY_BYTES >> 20} MiB; a policy is a "
            "short TOML file (mixprec.Policy.to_toml writes one)"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PolicyError(f"policy file {path!r} is not UTF-8 text ({err})") from None


def policy_from_spec(spec: object) -> Policy:
    """A policy from a key-grammar string, a ``.toml`` path, or a mapping."""
    if isinstance(spec, Mapping):
        return policy_from_mapping(spec)
    if isinstance(spec, os.PathLike) or (isinstance(spec, str) and spec.strip().endswith(".toml")):
        return read_toml(Path(spec))
    if isinstance(spec, str):
        return parse_spec(spec)
    raise PolicyError(
        "a policy spec is a preset name, a key-grammar string, a .toml path, a Policy or "
        f"a dict; got {type(spec).__name__}"
    )


# ---------------------------------------------------------------------- names and the front door


def preset_names() -> list[str]:
    """Built-in presets, their aliases, then presets contributed by plugins."""
    builtin = builtin_preset_names()
    return builtin + sorted(set(plugin_presets()) - set(builtin))


def preset(name: str) -> Policy:
    """The preset (or alias, or plugin preset) called ``name``.

    Plugins are loaded only when ``name`` is not built in.

    :raises PolicyError: no such preset; the message gives the close matches and every name.
    """
    found = builtin_preset(name)
    if found is not None:
        return found
    plugins = plugin_presets()
    if name in plugins:
        given = plugins[name]
        policy = given if isinstance(given, Policy) else policy_from_mapping(given)
        return dataclasses.replace(policy, name=name)
    names = preset_names()
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise PolicyError(
        f"unknown policy preset {name!r}.{hint} Valid presets: {', '.join(names)}. Or write a "
        "key-grammar spec such as 'base=O1,compute=bfloat16', or the path of a .toml file."
    )


def get_policy(spec: PolicySpec = "auto", **overrides: Any) -> Policy:
    """The policy ``spec`` names, with role ``overrides`` applied.

    :param spec: a preset or alias (``"O2"``, ``"bf16-mixed"``), a key-grammar string
        (``"base=O1,compute=bfloat16,fp32+=matmul"``), the path of a ``.toml`` file, a
        :class:`Policy`, or a mapping in :meth:`Policy.to_dict` form (partial ones build on
        ``"base"``). None means ``"auto"``.
    :param overrides: ``param`` (or ``params``), ``compute``, ``output``, ``master``,
        ``reduce``, ``state``, ``loss_scale``; :mod:`mixprec.policy.presets` says what a changed
        compute re-derives.
    :raises PolicyError: an unknown preset, key, dtype or op, or a contradictory policy.

    Example::

        import mixprec

        policy = mixprec.get_policy("O1-bf16,path:head=float32")
        policy.compute                          # 'bfloat16'
        mixprec.get_policy("O2", compute="bfloat16") == mixprec.get_policy("O2-bf16")  # True
        print(policy.explain("softmax"))        # the rule that decides softmax's dtype
    """
    if spec is None:
        spec = "auto"
    if isinstance(spec, Policy):
        policy = spec
    elif isinstance(spec, str) and not any(mark in spec for mark in ("=", ",", ".toml")):
        policy = preset(spec)
    else:
        policy = policy_from_spec(spec)
    return derive(policy, parsed_roles(overrides)) if overrides else policy


def load_toml(path_or_text: str | os.PathLike[str]) -> Policy:
    """A policy from a TOML file or TOML text (keys as in :meth:`Policy.from_dict`)."""
    return read_toml(path_or_text)


def resolve_for_device(
    spec: PolicySpec,
    backend: str,
    device: str,
    capabilities: Capabilities | None,
    *,
    check: Callable[[Policy], None] | None = None,
    **overrides: Any,
) -> Policy:
    """The concrete policy ``backend`` runs on ``device``; every backend resolves through this.

    In order: ``get_policy(spec, **overrides)``; ``auto`` resolved with
    ``capabilities.preferred_lowp(device)`` (:func:`mixprec.resolve_auto`); an ``fp8``
    recipe the device does not list (``DeviceCapability.fp8_recipes``) refused;
    ``check(policy)``,
    the backend's own refusal of dtypes it cannot run; then the ``mixprec_policy_resolved``
    hook with ``(policy, backend, device)``. So observers hear only of policies that passed.

    :param device: the device as ``capabilities`` names it (``"cpu"``, ``"cuda:0"``,
        ``"gpu(0)"``).
    :param capabilities: the backend's capabilities, or None for a device the backend cannot
        compute on (``auto`` then resolves to O0, with its warning).
    :raises BackendNotAvailable: ``capabilities`` has no entry for ``device``.
    :raises PolicyError: a bad spec or override; ``check``'s own errors pass through.
    :raises UnsupportedDtypeError: an ``fp8`` recipe the backend does not run on ``device``.
    """
    policy = get_policy(spec, **overrides)
    preferred = None if capabilities is None else capabilities.preferred_lowp(device)
    why = "" if capabilities is None else capabilities.device(device).note
    policy = resolve_auto(policy, preferred, why)
    if policy.fp8 is not None and capabilities is not None:
        _check_fp8(policy, backend, capabilities.device(device).fp8_recipes, device)
    if check is not None:
        check(policy)
    policy_resolved(policy, backend, device)
    return policy


def _check_fp8(policy: Policy, backend: str, recipes: tuple[str, ...], device: str) -> None:
    """Refuse an ``fp8`` recipe the backend does not run on ``device``, before it is used."""
    assert policy.fp8 is not None
    if policy.fp8.name in recipes:
        return
    if recipes:
        fix = f"use one of the recipes it runs there: {', '.join(recipes)} (fp8=<recipe>)"
    else:
        fix = (
            f"the {backend} backend runs no FP8 there; drop the fp8 item (policy "
            f"{str(dataclasses.replace(policy, fp8=None, name=None))!r}), or use a backend "
            "that runs FP8 (the torch backend emulates it on any CPU or CUDA device)"
        )
    raise UnsupportedDtypeError(
        f"policy {policy.label} asks for fp8={policy.fp8}, which the {backend} backend does "
        f"not run on {device}; {fix}"
    )
