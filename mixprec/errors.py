"""Errors and warnings raised by mixprec.

Every error mixprec raises on bad input is a :class:`MixprecError` subclass whose message
names the problem *and* the fix. Each subclass also derives from the builtin exception a
user would naturally catch (``ValueError``, ``RuntimeError`` ...), so existing
``except`` clauses keep working.
"""

from __future__ import annotations

__all__ = [
    "AdviceError",
    "BackendNotAvailable",
    "CheckpointError",
    "LockError",
    "LossScaleError",
    "MixprecError",
    "MixprecWarning",
    "PluginError",
    "PolicyError",
    "StepOrderError",
    "UnsupportedDtypeError",
    "WrapError",
]


class MixprecError(Exception):
    """Base class of every error mixprec raises on purpose."""


class PolicyError(MixprecError, ValueError):
    """A policy spec, dtype name, op name or module rule is invalid or contradictory."""


class StepOrderError(MixprecError, RuntimeError):
    """The scale/backward/unscale/step calls came in an order that cannot be right."""


class LossScaleError(MixprecError, FloatingPointError):
    """The dynamic loss scale hit its floor and the policy says to stop."""


class BackendNotAvailable(MixprecError, ImportError):
    """A backend was asked for but its framework or plugin is not installed."""


class PluginError(MixprecError):
    """A plugin failed to load, or two plugins claim the same backend name."""


class WrapError(MixprecError, ValueError):
    """Models and optimizers were handed to a backend in a way it cannot honour."""


class UnsupportedDtypeError(MixprecError, ValueError):
    """The policy asks for a dtype the device cannot compute in."""


class CheckpointError(MixprecError, ValueError):
    """A checkpoint does not match the model, optimizer or policy it is loaded into."""


class AdviceError(MixprecError, ValueError):
    """The advisor was given something it cannot run (the message says what to pass)."""


class LockError(MixprecError, ValueError):
    """A precision lock file is damaged, truncated or edited beyond reading, or is checked
    against another backend than the one it was written for."""


class DistributedError(MixprecError, RuntimeError):
    """A collective mixprec runs across ranks (the per-step overflow check) did not complete:
    another rank failed, hangs or left the step protocol."""


class MixprecWarning(UserWarning):
    """A setting works but is probably not what was meant (the message says the fix)."""
