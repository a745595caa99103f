"""What a backend declares about itself (declarations only).

A backend is two modules. Its *plugin* module (registered under the ``mixprec`` entry-point
group) answers :func:`mixprec.engine.hookspecs.mixprec_register_backends` with a
:class:`BackendInfo` and never imports the framework. Its *api* module, named by
``BackendInfo.api_module``, holds the user API and imports the framework; mixprec imports it
on first use through :func:`mixprec.engine.plugins.load_backend`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mixprec.errors import BackendNotAvailable, PluginError

__all__ = ["BackendInfo", "Capabilities", "DeviceCapability", "NativeDtypes", "UnseenOp"]

# Low-precision dtypes in the order ``auto`` prefers them: bfloat16 needs no loss scaling.
_LOWP_PREFERENCE = ("bfloat16", "float16")


@dataclass(frozen=True)
class BackendInfo:
    """A backend as its plugin declares it, before the framework is imported.

    :param name: the backend's name, used in ``mixprec.<name>`` and ``mixprec backends``.
    :param framework: the distribution that provides the framework (for its version and for
        the "not installed" message), such as ``"torch"``.
    :param api_module: import path of the module holding the user API, such as
        ``"mixprec_torch"``. It must define ``capabilities()`` and ``conformance_adapter()``.
    :param extra: the pip extra of ``mixprec`` that installs the framework.
    :param description: one line shown by ``mixprec backends``.
    """

    name: str
    framework: str
    api_module: str
    extra: str = ""
    description: str = ""

    def install_hint(self) -> str:
        """The pip command that installs what this backend needs."""
        if self.extra:
            return f"pip install 'mixprec[{self.extra}]'"
        return f"pip install {self.framework}"


@dataclass(frozen=True)
class DeviceCapability:
    """What one device can compute in.

    :param device: the device as the framework names it: ``"cpu"``, ``"cuda:0"``, ``"gpu(0)"``.
    :param compute_dtypes: canonical dtypes its matrix multiply and convolution run in.
    :param fast_dtypes: low-precision dtypes that run faster than float32 on it.
    :param note: the hardware facts behind the two lists, in the user's words (``"compute
        capability 7.5: no bfloat16 (needs 8.0, Ampere)"``); shown by ``mixprec backends``,
        by ``auto``'s float32 warning and by refusals, so they name the missing feature.
    :param fp8_recipes: the FP8 recipes (:data:`mixprec.numerics.fp8.recipes.FP8_RECIPES`)
        the backend runs on it, natively or emulated; a policy with another ``fp8`` recipe is
        refused there.
    """

    device: str
    compute_dtypes: tuple[str, ...]
    fast_dtypes: tuple[str, ...] = ()
    note: str = ""
    fp8_recipes: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line such as ``cpu: float32, bfloat16 (fast: bfloat16) — avx512_bf16``."""
        fast = f" (fast: {', '.join(self.fast_dtypes)})" if self.fast_dtypes else ""
        fp8 = f" (fp8: {', '.join(self.fp8_recipes)})" if self.fp8_recipes else ""
        note = f" — {self.note}" if self.note else ""
        return f"{self.device}: {', '.join(self.compute_dtypes)}{fast}{fp8}{note}"


#: What a framework does with an op family a backend cannot see (:class:`UnseenOp`).
NATIVE_BEHAVIOURS = ("promote", "passthrough", "absent")


@dataclass(frozen=True)
class UnseenOp:
    """An op family whose rules a backend cannot apply, because it never sees the op.

    A functional framework offers no hook on every op: JAX's ``x + y`` reaches no function
    a plugin can wrap. The backend declares such families in
    :attr:`Capabilities.unseen_ops`, with what the framework does natively, so that
    :mod:`mixprec.engine.visibility` can refuse a policy that needs a cast there and
    ``explain``/``dtype_report`` can tell the user which rules are only the framework's
    own behaviour.

    :param op: the neutral op family (:data:`mixprec.policy.ops.OP_FAMILIES`).
    :param native: what the framework does with it: ``"promote"`` (computes in the widest
        floating input, as JAX's type promotion does), ``"passthrough"`` (in the dtype that
        comes in), or ``"absent"`` (the framework has no such op: code doing the same is
        written out in other ops, and a rule on it has nothing to act on).
    :param why: one phrase saying why the backend cannot see it, for messages.
    """

    op: str
    native: str
    why: str = ""

    def __post_init__(self) -> None:
        if self.native not in NATIVE_BEHAVIOURS:
            raise PluginError(
                f"UnseenOp({self.op!r}).native must be one of {NATIVE_BEHAVIOURS}, "
                f"got {self.native!r}"
            )


@dataclass(frozen=True)
class Capabilities:
    """A backend's capabilities, as reported by its api module's ``capabilities()``.

    ``unseen_ops`` (default: none, every op family the backend maps asks the policy)
    lists the op families whose rules the backend cannot apply (:class:`UnseenOp`).
    """

    backend: str
    framework_version: str
    devices: tuple[DeviceCapability, ...]
    unseen_ops: tuple[UnseenOp, ...] = ()

    def unseen(self, op: str) -> UnseenOp | None:
        """The :class:`UnseenOp` entry of ``op``, or None when the backend sees it."""
        return next((entry for entry in self.unseen_ops if entry.op == op), None)

    def device(self, device: str) -> DeviceCapability:
        """The entry for ``device``; a bare ``"cuda"`` or ``"gpu"`` matches its first device."""
        for cap in self.devices:
            if cap.device == device or cap.device.split(":")[0].split("(")[0] == device:
                return cap
        known = ", ".join(cap.device for cap in self.devices) or "none"
        raise BackendNotAvailable(
            f"The {self.backend} backend reports no device {device!r} (devices here: {known}); "
            "pass one of those, or a bare 'cpu'/'cuda'/'gpu' for the first of its kind."
        )

    def preferred_lowp(self, device: str) -> str | None:
        """The low-precision dtype ``auto`` should pick on ``device``, or None for float32."""
        fast = self.device(device).fast_dtypes
        return next((dtype for dtype in _LOWP_PREFERENCE if dtype in fast), None)


@dataclass(frozen=True)
class NativeDtypes:
    """What a framework's own mixed precision does with each op: a backend's answer to
    :func:`mixprec.engine.hookspecs.mixprec_native_dtypes`, recorded by the precision lockfile.

    :param source: what was asked, in the framework's words, such as
        ``"torch.autocast('cuda', dtype=torch.float16)"``.
    :param dtypes: op name (a neutral family, or ``"<backend>:<native>"`` for an op outside
        the vocabulary) -> input dtype (``"float32"`` and the low-precision dtype asked
        about) -> the dtype the op computes in, or None where the op refuses those inputs.
    """

    source: str
    dtypes: Mapping[str, Mapping[str, str | None]]
