"""Every hook mixprec calls, in one place.

Plugins implement these with ``@mixprec.hookimpl`` in a module registered under the
``mixprec`` entry-point group. Each hook's docstring follows one template: a summary, the
parameters, what it returns, whether it is ``firstresult``, and a paragraph for backend
authors. The reference page ``docs/plugins.md`` is checked against this file by the tests.

Core code never calls ``pm.hook.<name>(...)`` directly: it goes through the typed wrappers in
:mod:`mixprec.engine.plugins`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from mixprec.backend import BackendInfo, NativeDtypes
    from mixprec.events import ScaleEvent
    from mixprec.policy.value import Policy

PROJECT_NAME = "mixprec"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

# ---------------------------------------------------------------------------------------
# Registration: asked once, when plugins are first loaded
# ---------------------------------------------------------------------------------------


@hookspec
def mixprec_register_backends() -> Sequence[BackendInfo]:
    """Declare the backends this plugin provides.

    :returns: a sequence of :class:`mixprec.backend.BackendInfo`, usually one. Results from
        all plugins are concatenated; two plugins declaring the same backend name is an
        error reported by :func:`mixprec.engine.plugins.list_backends`.

    Not ``firstresult``.

    For backend authors: this is called without importing your framework, so the module
    holding it must not import it at module level. ``BackendInfo.api_module`` names the
    module that does; mixprec imports it only when the backend is first used.
    """
    raise NotImplementedError  # pragma: no cover - specification only


@hookspec
def mixprec_presets() -> Mapping[str, Policy | Mapping[str, Any]]:
    """Contribute named policy presets.

    :returns: a mapping from preset name to a :class:`mixprec.policy.value.Policy` or to its
        ``to_dict()`` form. Names must not collide with built-in presets or aliases.

    Not ``firstresult``: presets from every plugin are merged.

    For backend authors: called only when :func:`mixprec.get_policy` meets a name that is
    not built in, so building the presets may import your framework (the PyTorch backend
    reads ``torch.autocast``'s own op lists here).
    """
    raise NotImplementedError  # pragma: no cover - specification only


# ---------------------------------------------------------------------------------------
# Locking a policy: what the framework does natively
# ---------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def mixprec_native_dtypes(backend: str, device: str, compute: str) -> NativeDtypes | None:
    """Say what the framework's own mixed precision does with each op, for a precision lock.

    :param backend: the backend the lock is for; answer for your own backend only and
        return None for every other name.
    :param device: the device type the lock is for: ``"cpu"`` or ``"cuda"``.
    :param compute: the low-precision dtype (``"float16"`` or ``"bfloat16"``) the
        framework's mixed precision would run in.
    :returns: a :class:`mixprec.backend.NativeDtypes`: for each neutral family you map (and
        for ``"<backend>:<native>"`` ops outside the vocabulary that your framework's mixed
        precision decides), the dtype it computes in for float32 inputs and for ``compute``
        inputs; or None when ``backend`` is not yours.

    ``firstresult``: the first plugin that answers for ``backend`` wins.

    For backend authors: ``mixprec lock`` writes these answers into the lock file and
    ``mixprec lock --check`` asks again, so a framework upgrade that moves an op between its
    own lists is named. Read your framework's lists or probe its dispatch (the PyTorch
    backend runs ``torch.autocast`` on fake CUDA tensors, so no GPU is needed); never
    depend on the machine's CPU features, and import the framework inside the hook, never
    at module level. Raise :class:`mixprec.BackendNotAvailable` for a device you cannot
    answer for.
    """
    raise NotImplementedError  # pragma: no cover - specification only


# ---------------------------------------------------------------------------------------
# Wrap time: a backend has resolved the policy for a device
# ---------------------------------------------------------------------------------------


@hookspec
def mixprec_policy_resolved(policy: Policy, backend: str, device: str) -> None:
    """Observe the policy a backend settled on at wrap time.

    :param policy: the resolved policy (``auto`` already turned into a concrete preset).
    :param backend: the backend's name, such as ``"torch"``.
    :param device: the device the policy was resolved for, such as ``"cpu"`` or ``"cuda:0"``.
    :returns: nothing.

    Not ``firstresult``.

    For backend authors: resolve your policy once per wrap with
    :func:`mixprec.engine.spec.resolve_for_device`, which fires this hook after ``auto`` is
    resolved and your own dtype check passed, so loggers see exactly what will run.
    """


# ---------------------------------------------------------------------------------------
# Every step: the loss scaler changed or a step was skipped
# ---------------------------------------------------------------------------------------


@hookspec
def mixprec_scale_event(event: ScaleEvent, step: int) -> None:
    """Observe a loss-scale event: a skip, a backoff, a growth or the floor.

    :param event: the :class:`mixprec.events.ScaleEvent` (kind, scale before and after).
    :param step: the scaler's step count when the event happened (0-based).
    :returns: nothing.

    Not ``firstresult``.

    For backend authors: :class:`mixprec.engine.scaler.LossScaler` emits these for you; a backend
    that drives the core scaler never calls this hook itself.
    """


@hookspec
def mixprec_step_skipped(step: int, loss_scale: float) -> None:
    """Observe an optimizer step skipped because gradients were not finite.

    :param step: the scaler's step count of the skipped step (0-based).
    :param loss_scale: the loss scale that step ran with.
    :returns: nothing.

    Not ``firstresult``.

    For backend authors: emitted by :class:`mixprec.engine.scaler.LossScaler` after the
    cross-rank reduction, so every rank reports the same skips. Schedulers and loggers hook
    here to stay in step with skipped updates.
    """
