"""The plugin manager: lazy entry-point loading, :func:`load_backend`, typed hook wrappers.

Plugins are loaded on first need, never at ``import mixprec``. Each entry point in the
``mixprec`` group is loaded on its own, so one that fails to import or implements a hook
with the wrong signature is recorded by name (``mixprec backends`` shows it) and the others
keep working. ``MIXPREC_DISABLE_PLUGINS`` blocks plugins by entry-point name
(comma-separated, or ``*`` for all of them).

Core code calls hooks only through the functions below, never ``pm.hook.<name>`` directly.

Thread safety: the first call of :func:`get_plugin_manager` from any number of threads
builds one manager and loads each entry point once (a lock guards the build and every
change to the registry); later calls read the built manager without locking. The backend
cache of :func:`load_backend` relies on Python's per-module import locks: two threads that
load the same backend get the same module.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import importlib.util
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

import pluggy

from mixprec.backend import BackendInfo, NativeDtypes
from mixprec.engine import hookspecs
from mixprec.errors import BackendNotAvailable, PluginError

if TYPE_CHECKING:
    from mixprec.events import ScaleEvent
    from mixprec.policy.value import Policy

__all__ = [
    "KNOWN_PLUGINS",
    "BackendStatus",
    "backend_info",
    "broken_plugins",
    "disabled_plugins",
    "emit_scale_event",
    "emit_step_skipped",
    "get_plugin_manager",
    "list_backends",
    "load_backend",
    "native_dtypes",
    "plugin_preset_sources",
    "plugin_presets",
    "policy_resolved",
    "register",
    "reset",
]

DISABLE_ENV = "MIXPREC_DISABLE_PLUGINS"

#: Names people try for a backend, and the name it is registered under.
BACKEND_ALIASES: dict[str, str] = {
    "pytorch": "torch",
    "pt": "torch",
    "gluon": "mxnet",
    "mx": "mxnet",
    "np": "numpy",
}

#: Backends third-party plugins provide, as ``name -> (distribution, mixprec extra)``, so
#: that ``mixprec.<name>`` and :func:`load_backend` say what to install when the plugin is
#: missing instead of reporting an unknown name.
KNOWN_PLUGINS: dict[str, tuple[str, str]] = {
    "jax": ("mixprec-jax", "jax"),
}

# Every module-level global below is read without a lock and changed only under _lock.
_lock = threading.RLock()  # re-entrant: register() and reset() call functions that take it
_pm: pluggy.PluginManager | None = None
_broken: dict[str, str] = {}
_disabled: dict[str, str] = {}  # entry-point name -> its target, blocked by DISABLE_ENV
_listening: dict[str, bool] = {}
_loaded: dict[str, ModuleType] = {}


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
    """The process-wide plugin manager, loading the entry points on the first call.

    Thread-safe: concurrent first calls build one manager and load each entry point once.
    """
    pm = _pm
    if pm is not None:
        return pm
    with _lock:
        return _pm if _pm is not None else _build_manager()


def _build_manager() -> pluggy.PluginManager:
    """Build the manager and publish it (the caller holds ``_lock``)."""
    global _pm
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    blocked = _blocked()
    for ep in importlib.metadata.entry_points(group=hookspecs.PROJECT_NAME):
        if "*" in blocked or ep.name in blocked:
            _disabled[ep.name] = ep.value
            continue
        if pm.has_plugin(ep.name):
            continue
        try:
            plugin = ep.load()
        except Exception as exc:  # a broken plugin must not break the others
            _broken[ep.name] = f"{type(exc).__name__}: {exc}"
            continue
        _register_checked(pm, plugin, ep.name)
    _pm = pm  # published last: a reader without the lock never sees a half-built manager
    return pm


def register(plugin: object, name: str | None = None) -> None:
    """Register an in-process plugin (a module or an object with ``@hookimpl`` methods).

    A plugin that does not match the hook specifications is recorded as broken, like a
    broken entry point, and raises :class:`~mixprec.errors.PluginError`.
    """
    label = name or getattr(plugin, "__name__", None) or type(plugin).__name__
    with _lock:
        pm = get_plugin_manager()
        _broken.pop(label, None)
        _register_checked(pm, plugin, label)
        _listening.clear()
        error = _broken.get(label)
    if error is not None:
        raise PluginError(f"plugin {label!r} does not match mixprec's hooks: {error}")


def reset() -> None:
    """Forget every loaded plugin and backend (for tests): the next call loads them again."""
    global _pm
    with _lock:
        _pm = None
        _broken.clear()
        _disabled.clear()
        _listening.clear()
        _loaded.clear()


def broken_plugins() -> dict[str, str]:
    """Plugins that failed to load or validate: name -> the error, as text."""
    get_plugin_manager()
    return dict(_broken)


def disabled_plugins() -> dict[str, str]:
    """Entry points blocked by ``MIXPREC_DISABLE_PLUGINS``: name -> the module it names."""
    get_plugin_manager()
    return dict(_disabled)


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
            with _lock:
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
        raise BackendNotAvailable(_unknown_backend(name))
    return matches[0][1]


def _unknown_backend(name: str) -> str:
    """Why no plugin declares ``name``, and what to do about it."""
    if name in _disabled or (_disabled and "*" in _blocked()):
        return (
            f"the {name!r} backend is disabled: {DISABLE_ENV}={os.environ.get(DISABLE_ENV, '')!r} "
            f"blocks its plugin. Remove {name!r} from {DISABLE_ENV} (or unset it) to use it"
        )
    if name in _broken:
        return (
            f"the {name!r} backend's plugin failed to load: {_broken[name]}. Fix or reinstall "
            "that plugin (`mixprec backends` lists every plugin and its state)"
        )
    declared = {info.name: info for _, info in _declared()}
    known = ", ".join(sorted(declared)) or "none"
    if name in KNOWN_PLUGINS and name not in declared:
        distribution, extra = KNOWN_PLUGINS[name]
        return (
            f"the {name!r} backend comes from the {distribution} plugin, which is not "
            f"installed. Install it with: pip install 'mixprec[{extra}]' (from a source "
            f"checkout: pip install ./plugins/{distribution}). Installed backends: {known}"
        )
    guess = BACKEND_ALIASES.get(name.strip().lower())
    if guess not in declared:
        close = difflib.get_close_matches(name, list(declared), n=1, cutoff=0.6)
        guess = close[0] if close else None
    if guess is not None:
        return (
            f"no backend named {name!r}. Did you mean {guess!r}? Use mixprec.load_backend"
            f"({guess!r}) or mixprec.{guess}; its framework installs with "
            f"{declared[guess].install_hint()}. Installed backends: {known}"
        )
    return (
        f"no backend named {name!r} is installed; installed backends: {known}. A backend is "
        "a plugin registered under the 'mixprec' entry-point group: install its package "
        "(`mixprec backends` lists what is there)"
    )


def load_backend(name: str) -> ModuleType:
    """Import and return the api module of backend ``name`` (cached).

    :raises BackendNotAvailable: no plugin declares ``name`` (the message suggests the right
        name, or says the plugin is disabled by ``MIXPREC_DISABLE_PLUGINS``), or its
        framework is missing (the message names the pip extra to install).
    :raises PluginError: two plugins claim ``name``, or the api module fails to import.
    """
    module = _loaded.get(name)
    if module is not None:
        return module
    info = backend_info(name)
    if importlib.util.find_spec(info.framework) is None:
        raise BackendNotAvailable(
            f"The {name!r} backend needs {info.framework}, which is not installed. "
            f"Install it with: {info.install_hint()}"
        )
    try:
        # No lock held here: the import system serialises importing one module, and every
        # thread gets the same module object, so the cache below stays consistent.
        module = importlib.import_module(info.api_module)
    except ImportError as exc:
        raise BackendNotAvailable(
            f"The {name!r} backend could not import {info.api_module!r}: {exc}. "
            f"Reinstall it with: {info.install_hint()}"
        ) from exc
    except Exception as exc:
        raise PluginError(
            f"The {name!r} backend's module {info.api_module!r} failed while importing: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    _loaded[name] = module
    return module


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


def plugin_preset_sources() -> dict[str, str]:
    """Each plugin preset's name and the plugin (entry-point name) that contributes it, for
    ``mixprec policies``; a plugin whose framework is missing contributes none."""
    sources: dict[str, str] = {}
    for impl in get_plugin_manager().hook.mixprec_presets.get_hookimpls():
        try:
            presets = cast("Mapping[str, object]", impl.function())
        except BackendNotAvailable:
            continue
        sources.update(dict.fromkeys(presets, impl.plugin_name))
    return sources


def native_dtypes(backend: str, device: str, compute: str) -> NativeDtypes | None:
    """What ``backend``'s framework does natively with each op (the lockfile's question), or
    None when no plugin answers for it (``mixprec_native_dtypes``)."""
    answer = get_plugin_manager().hook.mixprec_native_dtypes(
        backend=backend, device=device, compute=compute
    )
    return cast("NativeDtypes | None", answer)


def _has_listeners(hook: str) -> bool:
    listening = _listening.get(hook)
    if listening is None:
        with _lock:  # computed under the lock, so a concurrent register() cannot go unseen
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
