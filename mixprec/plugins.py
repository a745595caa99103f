"""The plugin manager: lazy entry-point loading and typed wrappers around every hook.

Plugins are loaded on first need, never at ``import mixprec``. Each entry point in the
``mixprec`` group is loaded on its own, so one that fails to import or implements a hook
with the wrong signature is recorded by name (``mixprec backends`` shows it) and the others
keep working. ``MIXPREC_DISABLE_PLUGINS`` blocks plugins by entry-point name
(comma-separated, or ``*`` for all of them).

Core code calls hooks only through the functions below, never ``pm.hook.<name>`` directly.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import pluggy

from mixprec import hookspecs
from mixprec.backend import BackendInfo
from mixprec.errors import BackendNotAvailable, PluginError

if TYPE_CHECKING:
    from mixprec.events import ScaleEvent
    from mixprec.policy import Policy

__all__ = [
    "BackendStatus",
    "backend_info",
    "broken_plugins",
    "emit_scale_event",
    "emit_step_skipped",
    "get_plugin_manager",
    "list_backends",
    "plugin_presets",
    "policy_resolved",
    "register",
    "reset",
]

DISABLE_ENV = "MIXPREC_DISABLE_PLUGINS"

_pm: pluggy.PluginManager | None = None
_broken: dict[str, str] = {}
_listening: dict[str, bool] = {}


def _blocked() -> set[str]:
    raw = os.environ.get(DISABLE_ENV, "")
    return {name.strip() for name in raw.split(",") if name.strip()}


def _register_checked(pm: pluggy.PluginManager, plugin: object, name: str) -> None:
    """Register ``plugin`` and validate it against the specs, or record it as broken."""
    try:
        pm.register(plugin, name=name)
        pm.check_pending()
    except Exception as exc:
        if pm.is_registered(plugin):
            pm.unregister(plugin)
        _broken[name] = f"{type(exc).__name__}: {exc}"


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, loading the entry points on the first call."""
    global _pm
    if _pm is not None:
        return _pm
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    blocked = _blocked()
    for ep in importlib.metadata.entry_points(group=hookspecs.PROJECT_NAME):
        if "*" in blocked or ep.name in blocked or pm.has_plugin(ep.name):
            continue
        try:
            plugin = ep.load()
        except Exception as exc:  # a broken plugin must not break the others
            _broken[ep.name] = f"{type(exc).__name__}: {exc}"
            continue
        _register_checked(pm, plugin, ep.name)
    _pm = pm
    return pm


def register(plugin: object, name: str | None = None) -> None:
    """Register an in-process plugin (a module or an object with ``@hookimpl`` methods).

    A plugin that does not match the hook specifications is recorded as broken, like a
    broken entry point, and raises :class:`~mixprec.errors.PluginError`.
    """
    pm = get_plugin_manager()
    label = name or getattr(plugin, "__name__", None) or type(plugin).__name__
    _broken.pop(label, None)
    _register_checked(pm, plugin, label)
    _listening.clear()
    if label in _broken:
        raise PluginError(f"plugin {label!r} does not match mixprec's hooks: {_broken[label]}")


def reset() -> None:
    """Forget every loaded plugin (for tests): the next call loads entry points again."""
    global _pm
    _pm = None
    _broken.clear()
    _listening.clear()
    from mixprec import backend

    backend._loaded.clear()


def broken_plugins() -> dict[str, str]:
    """Plugins that failed to load or validate: name -> the error, as text."""
    get_plugin_manager()
    return dict(_broken)


# ---------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BackendStatus:
    """One row of ``mixprec backends``: a declared backend and whether it can be used."""

    info: BackendInfo
    plugin: str
    framework_version: str | None
    error: str | None = None

    @property
    def usable(self) -> bool:
        """True when the framework is installed and no other plugin claims the name."""
        return self.error is None


def _declared() -> list[tuple[str, BackendInfo]]:
    pm = get_plugin_manager()
    pairs: list[tuple[str, BackendInfo]] = []
    for impl in pm.hook.mixprec_register_backends.get_hookimpls():
        try:
            infos = cast("Sequence[BackendInfo]", impl.function())
        except Exception as exc:
            _broken[impl.plugin_name] = f"mixprec_register_backends failed: {exc}"
            continue
        pairs.extend((impl.plugin_name, info) for info in infos)
    return pairs


def _framework_version(framework: str) -> str | None:
    if importlib.util.find_spec(framework) is None:
        return None
    try:
        return importlib.metadata.version(framework)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def list_backends() -> list[BackendStatus]:
    """Every declared backend with its framework version, without importing any framework."""
    declared = _declared()
    owners: dict[str, list[str]] = {}
    for plugin, info in declared:
        owners.setdefault(info.name, []).append(plugin)
    rows = []
    for plugin, info in declared:
        version = _framework_version(info.framework)
        error = None
        if len(owners[info.name]) > 1:
            error = f"backend name {info.name!r} is claimed by plugins {sorted(owners[info.name])}"
        elif version is None:
            error = f"{info.framework} is not installed ({info.install_hint()})"
        rows.append(BackendStatus(info, plugin, version, error))
    return sorted(rows, key=lambda row: row.info.name)


def backend_info(name: str) -> BackendInfo:
    """The :class:`BackendInfo` declared for ``name``.

    :raises BackendNotAvailable: no plugin declares it (the message lists the ones that do).
    :raises PluginError: more than one plugin declares it.
    """
    matches = [(plugin, info) for plugin, info in _declared() if info.name == name]
    if len(matches) > 1:
        plugins = sorted(plugin for plugin, _ in matches)
        raise PluginError(
            f"backend {name!r} is claimed by several plugins {plugins}; uninstall one, or block "
            f"it with {DISABLE_ENV}={plugins[-1]}"
        )
    if not matches:
        known = sorted({info.name for _, info in _declared()})
        hint = f" ({name!r} failed to load: {_broken[name]})" if name in _broken else ""
        raise BackendNotAvailable(
            f"no backend named {name!r} is installed{hint}; installed backends: "
            f"{', '.join(known) or 'none'}. Built-in ones come with pip install 'mixprec[{name}]'."
        )
    return matches[0][1]


# ---------------------------------------------------------------------------------------
# Presets and observers
# ---------------------------------------------------------------------------------------


def plugin_presets() -> dict[str, Policy | Mapping[str, Any]]:
    """Presets contributed by plugins through ``mixprec_presets``, merged."""
    merged: dict[str, Policy | Mapping[str, Any]] = {}
    pm = get_plugin_manager()
    for impl in pm.hook.mixprec_presets.get_hookimpls():
        try:
            presets = cast("Mapping[str, Policy | Mapping[str, Any]]", impl.function())
            merged.update(presets)
        except BackendNotAvailable:
            continue  # that plugin's framework is missing: its presets are unavailable
    return merged


def _has_listeners(hook: str) -> bool:
    listening = _listening.get(hook)
    if listening is None:
        caller = getattr(get_plugin_manager().hook, hook)
        listening = _listening[hook] = bool(caller.get_hookimpls())
    return listening


def policy_resolved(policy: Policy, backend: str, device: str) -> None:
    """Tell observers which policy a backend resolved at wrap time."""
    if _has_listeners("mixprec_policy_resolved"):
        get_plugin_manager().hook.mixprec_policy_resolved(
            policy=policy, backend=backend, device=device
        )


def emit_scale_event(event: ScaleEvent, step: int) -> None:
    """Tell observers about a loss-scale event (cheap when nobody listens)."""
    if _has_listeners("mixprec_scale_event"):
        get_plugin_manager().hook.mixprec_scale_event(event=event, step=step)


def emit_step_skipped(step: int, loss_scale: float) -> None:
    """Tell observers that a step was skipped (cheap when nobody listens)."""
    if _has_listeners("mixprec_step_skipped"):
        get_plugin_manager().hook.mixprec_step_skipped(step=step, loss_scale=loss_scale)
