"""Locking a policy: record what each op resolves to now, and name what changed later.

``mixprec lock POLICY --backend NAME [--device cpu|cuda] -o FILE`` writes a precision lock
(:mod:`mixprec.policy.lockfile`): the mixprec, framework and Python versions, the device, and for
every op family the dtype it computes in for float32 and for low-precision inputs with the
rule that decided. For the ops a casting (O1-style) policy passes through, the lock also
records what the framework's own mixed precision does with them, as the backend answers
:func:`mixprec.engine.hookspecs.mixprec_native_dtypes` (PyTorch: ``torch.autocast``, probed, CUDA
on fake tensors; Gluon: ``mxnet.contrib.amp``'s lists; NumPy: its type rules), plus the
framework's own ops outside the vocabulary that it reports (``torch:rms_norm``).

``mixprec lock --check FILE`` resolves the same policy with what is installed now: exit 0
when every op resolves as locked, else exit 1 and one line per changed op::

    layer_norm: float32 -> bfloat16 (torch 2.13.0 -> 2.14.0)

A damaged, truncated or hand-mangled file (or one larger than a policy file may be,
:data:`~mixprec.engine.spec.MAX_POLICY_BYTES`), a lock checked against another backend or
device, an output path no lock can be written to, or an unknown policy exits 2 with the
reason (:class:`~mixprec.errors.LockError`,
:class:`~mixprec.errors.PolicyError`, :class:`~mixprec.errors.BackendNotAvailable`).
The Python API is :func:`write_lock`, :func:`make_lock`, :func:`read_lock` and
:func:`check_lock`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mixprec.atomic import atomic_write_text
from mixprec.dtypes import BFLOAT16, is_low_precision
from mixprec.engine.plugins import backend_info, load_backend, native_dtypes
from mixprec.engine.spec import MAX_POLICY_BYTES, PolicySpec, get_policy
from mixprec.errors import BackendNotAvailable, LockError, PolicyError
from mixprec.policy.lockfile import BANNED, REFUSED, OpLock, PrecisionLock, changes, read_lock_file
from mixprec.policy.ops import OP_FAMILIES, ban_advice
from mixprec.policy.presets import resolve_auto
from mixprec.policy.value import Policy

__all__ = ["LockCheck", "add_parser", "check_lock", "make_lock", "read_lock", "write_lock"]

DEVICES = ("cpu", "cuda")


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _policy_text(policy: PolicySpec, folder: Path | None) -> str:
    """How the lock names the policy: a file's path relative to the lock's folder, else the
    spec as given (a Policy as its key-grammar string)."""
    if isinstance(policy, os.PathLike) or (
        isinstance(policy, str) and policy.strip().endswith(".toml")
    ):
        path = Path(policy).resolve()
        return os.path.relpath(path, folder) if folder is not None else str(path)
    if isinstance(policy, str):
        return policy
    if isinstance(policy, Policy):
        return str(policy)
    raise PolicyError(
        f"lock a preset name, a key-grammar string, a .toml path or a Policy, not "
        f"{type(policy).__name__}"
    )


def _resolve(spec: PolicySpec, backend: str, device: str, folder: Path | None) -> Policy:
    text = str(spec)
    if isinstance(spec, str) and text.strip().endswith(".toml") and folder is not None:
        spec = folder / text
    policy = get_policy(spec)
    if not policy.is_resolved:
        capabilities = load_backend(backend).capabilities()
        try:
            preferred = capabilities.preferred_lowp(device)
        except BackendNotAvailable:
            raise LockError(
                f"policy {text!r} is 'auto', which the {backend} backend resolves from the "
                f"device, and there is no {device} device here; lock a concrete policy instead "
                "(such as O1-bf16 or O1)"
            ) from None
        policy = resolve_auto(policy, preferred)
    return policy


def _decided(policy: Policy, op: str, dtype: str) -> tuple[str, str]:
    try:
        decision = policy.decide(op, (dtype,))
    except PolicyError:
        return BANNED, f"banned: {ban_advice(op)}"
    return decision.dtype, decision.rule


def _locked(policy: Policy, text: str, backend: str, device: str) -> PrecisionLock:
    info = backend_info(backend)
    if device not in DEVICES:
        raise LockError(f"lock for device 'cpu' or 'cuda', not {device!r}")
    load_backend(backend)  # the framework must be installed: BackendNotAvailable names it
    lowp = policy.compute if is_low_precision(policy.compute) else BFLOAT16
    native = native_dtypes(backend, device, lowp) if policy.casts_ops else None
    names = list(OP_FAMILIES)
    if native is not None:
        names += sorted(op for op in native.dtypes if ":" in op)
    ops = {}
    for name in names:
        float32, _ = _decided(policy, name, "float32")
        low, rule = _decided(policy, name, lowp)
        entry = OpLock(rule, float32, low)
        answer = None if native is None else native.dtypes.get(name)
        passes = policy.ops.list_of(name) in (None, "passthrough")
        if passes and answer is not None and {"float32", lowp} <= set(answer):
            entry = replace(
                entry,
                native_float32=answer["float32"] or REFUSED,
                native_lowp=answer[lowp] or REFUSED,
            )
        ops[name] = entry
    versions = {
        "mixprec": _version("mixprec"),
        info.framework: _version(info.framework),
        "python": platform.python_version(),
    }
    return PrecisionLock(
        policy=text,
        resolved=str(policy),
        backend=backend,
        device=device,
        lowp=lowp,
        native="" if native is None else native.source,
        versions=versions,
        ops=ops,
    )


def make_lock(
    policy: PolicySpec, backend: str, device: str = "cpu", *, folder: Path | None = None
) -> PrecisionLock:
    """The lock of ``policy`` on ``backend`` and ``device`` with what is installed now.

    :param policy: a preset, a key-grammar spec, the path of a policy TOML file, or a Policy.
    :param backend: a registered backend (``"torch"``, ``"mxnet"``, ``"numpy"``).
    :param device: ``"cpu"`` or ``"cuda"`` (no GPU needed: the backend probes or reads lists).
    :param folder: the folder the lock will be written to (a policy file's path is recorded
        relative to it).
    :raises PolicyError: an unknown policy. :raises BackendNotAvailable: an unknown backend,
        or its framework is not installed. :raises LockError: an unknown device.
    """
    text = _policy_text(policy, folder)
    if isinstance(policy, str) and policy.strip().endswith(".toml"):
        policy = Path(policy)  # read where it is now; the lock records it relative to folder
    return _locked(_resolve(policy, backend, device, None), text, backend, device)


def _unwritable(path: str | os.PathLike[str], why: object) -> LockError:
    return LockError(
        f"cannot write the lock file {os.fspath(path)!r}: {why}; give -o the path of a file "
        "in a folder you can write (such as precision.lock)"
    )


def write_lock(
    policy: PolicySpec, backend: str, path: str | os.PathLike[str], device: str = "cpu"
) -> PrecisionLock:
    """Write the lock of ``policy`` on ``backend`` and ``device`` to ``path`` (atomically);
    return it. Errors as :func:`make_lock`, and :class:`~mixprec.errors.LockError` for a
    ``path`` no file can be written to (empty, a folder, a device, a folder that cannot
    hold it), nothing written."""
    if not os.fspath(path):
        raise _unwritable(path, "the path is empty")
    out = Path(path)
    if out.is_dir():
        raise _unwritable(path, "it is a folder")
    lock = make_lock(policy, backend, device, folder=out.resolve().parent)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, lock.to_toml())
    except OSError as err:
        raise _unwritable(path, err.strerror or err) from None
    return lock


def read_lock(path: str | os.PathLike[str]) -> PrecisionLock:
    """The lock in file ``path`` (at most :data:`~mixprec.engine.spec.MAX_POLICY_BYTES`, the
    policy files' cap). :raises LockError: not a readable lock."""
    return read_lock_file(path, max_bytes=MAX_POLICY_BYTES)


@dataclass(frozen=True)
class LockCheck:
    """The result of :func:`check_lock`: the lock, the same policy resolved now, and one line
    per op that changed (empty: nothing did)."""

    locked: PrecisionLock
    now: PrecisionLock
    changes: list[str]

    @property
    def ok(self) -> bool:
        """True when every op resolves as locked."""
        return not self.changes


def check_lock(
    path: str | os.PathLike[str], backend: str | None = None, device: str | None = None
) -> LockCheck:
    """Resolve the policy locked in ``path`` with what is installed now and compare.

    :param backend: when given, the backend the lock must be for.
    :param device: when given, the device the lock must be for.
    :raises LockError: the file is not a readable lock, or is for another backend or device.
    :raises PolicyError: the locked policy does not resolve any more (a policy file gone).
    :raises BackendNotAvailable: the lock's backend is not installed.
    """
    locked = read_lock(path)
    if backend is not None and backend != locked.backend:
        raise LockError(
            f"lock file {os.fspath(path)!r} is for the {locked.backend} backend, not {backend}; "
            f"check it with --backend {locked.backend}, or write a {backend} lock"
        )
    folder = Path(path).resolve().parent
    if locked.device not in DEVICES:
        raise LockError(f"lock file {os.fspath(path)!r} names device {locked.device!r}")
    if device is not None and device != locked.device:
        raise LockError(
            f"lock file {os.fspath(path)!r} is for device {locked.device}, not {device}; check "
            f"it with --device {locked.device} (or none), or write a {device} lock with "
            f"--device {device}"
        )
    policy = _resolve(locked.policy, locked.backend, locked.device, folder)
    now = _locked(policy, locked.policy, locked.backend, locked.device)
    return LockCheck(locked, now, changes(locked, now))


# ---------------------------------------------------------------------- the command


def _run(args: argparse.Namespace) -> int:
    if args.check is not None:
        if args.policy is not None:
            raise LockError("give a POLICY to lock or --check FILE, not both")
        result = check_lock(args.check, args.backend, args.device)
        for line in result.changes:
            print(line)
        if result.ok:
            moved = [
                f"{name} {old} -> {result.now.versions.get(name)}"
                for name, old in result.locked.versions.items()
                if result.now.versions.get(name) != old
            ]
            print(
                f"{args.check}: every op resolves as locked"
                + (f" ({', '.join(moved)})" if moved else "")
            )
        return 0 if result.ok else 1
    if args.policy is None or args.backend is None:
        raise LockError(
            "mixprec lock needs POLICY and --backend NAME to write a lock "
            "(mixprec lock O1-bf16 --backend torch -o precision.lock), or --check FILE"
        )
    device = args.device or "cpu"
    if args.output is None:
        print(make_lock(args.policy, args.backend, device, folder=Path.cwd()).to_toml())
    else:
        lock = write_lock(args.policy, args.backend, args.output, device)
        print(f"{args.output}: {len(lock.ops)} ops of {lock.resolved!r} locked")
    return 0


EPILOG = """examples:
  mixprec lock O1-bf16 --backend torch -o precision.lock
  mixprec lock O1 --backend torch --device cuda -o precision-cuda.lock
  mixprec lock policies/train.toml --backend mxnet -o gluon.lock
  mixprec lock --check precision.lock

--check exits 0 when every op resolves as locked, 1 with one line per changed op
(layer_norm: float32 -> bfloat16 (torch 2.13.0 -> 2.14.0)), 2 for a file it cannot read
as a lock (damaged, cut short, edited by hand, larger than 1 MiB, or for another
--backend or --device).
"""


def add_parser(sub: Any) -> None:
    """Add the ``lock`` subcommand to the ``mixprec`` parser's subparsers."""
    lock = sub.add_parser(
        "lock",
        help="record what each op resolves to; --check names what changed",
        description="Write a precision lock: the mixprec, framework and Python versions, the "
        "device, and for every op family the dtype it computes in for float32 and "
        "low-precision inputs with the rule that decided (and, for a policy that casts ops, "
        "what the framework's own mixed precision does with the ops it passes through). "
        "--check resolves a lock's policy again with what is installed and names each op "
        "that changed.",
        epilog=EPILOG,
    )
    lock.add_argument("policy", nargs="?", help="a preset, key-grammar spec or policy .toml")
    lock.add_argument("--backend", help="the backend to lock for (torch, mxnet, numpy...)")
    lock.add_argument(
        "--device",
        choices=DEVICES,
        help="the device to lock for (default: cpu); with --check, the device the lock must be for",
    )
    lock.add_argument("-o", "--output", help="the lock file to write (default: print it)")
    lock.add_argument("--check", metavar="FILE", help="compare FILE with what resolves now")
    lock.set_defaults(run=_run)
