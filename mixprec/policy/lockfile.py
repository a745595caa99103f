"""The precision lock file: its data, its TOML text, and what changed between two locks.

A lock (:class:`PrecisionLock`) records, for one policy on one backend and device, what each
op resolves to with the versions installed when it was written: for float32 inputs and for
low-precision inputs, the dtype the op computes in and the rule that decided
(:class:`OpLock`), and for the ops a casting policy passes through, what the framework's own
mixed precision (``torch.autocast``, ``mxnet.contrib.amp``'s lists) does with them.
:func:`mixprec.lock.write_lock` makes one and :func:`mixprec.lock.check_lock` compares it
with what the same policy resolves to now, through :func:`changes` here.

This module is data only: it reads and writes the file and compares two locks; it never
resolves a policy. The file carries a checksum of what it records, so a damaged, truncated
or hand-edited lock is refused instead of being read as drift: a file it cannot read as the
lock it wrote raises :class:`~mixprec.errors.LockError` naming the problem and the fix
(write the lock again).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mixprec.dtypes import POLICY_DTYPES
from mixprec.errors import LockError
from mixprec.policy.grammar import toml_dumps

__all__ = ["FORMAT", "OpLock", "PrecisionLock", "changes", "parse_lock", "read_lock_file"]

#: The lock file format this mixprec writes and reads.
FORMAT = 1
#: What an op's dtype may be besides a dtype: the policy bans it for these inputs.
BANNED = "banned"
#: A native answer for an op that refuses those inputs.
REFUSED = "refused"

_HEADER_KEYS = ("format", "policy", "resolved", "backend", "device", "lowp", "native")
#: The tables a lock file holds, and the keys of its ``[lock]`` table: anything else is
#: outside the checksum, so it is refused rather than ignored.
_TABLES = ("lock", "versions", "ops")
_LOCK_KEYS = (*_HEADER_KEYS, "checksum")
_WRITE_AGAIN = "Write it again with `mixprec lock POLICY --backend NAME -o FILE`"


@dataclass(frozen=True)
class OpLock:
    """What one op resolves to.

    :param rule: the rule that decided, for low-precision inputs (:meth:`Policy.decide`).
    :param float32: the dtype it computes in for float32 inputs (or ``"banned"``).
    :param lowp: the dtype it computes in for low-precision inputs (or ``"banned"``).
    :param native_float32: what the framework's own mixed precision makes it compute in for
        float32 inputs (``"refused"``: the op refuses them); None when not recorded.
    :param native_lowp: the same for low-precision inputs.
    """

    rule: str
    float32: str
    lowp: str
    native_float32: str | None = None
    native_lowp: str | None = None

    def fields(self) -> dict[str, str]:
        """The recorded fields, None ones left out (the form the file holds)."""
        values = {
            "rule": self.rule,
            "float32": self.float32,
            "lowp": self.lowp,
            "native_float32": self.native_float32,
            "native_lowp": self.native_lowp,
        }
        return {key: value for key, value in values.items() if value is not None}


@dataclass(frozen=True)
class PrecisionLock:
    """A policy's op decisions on one backend and device, with the versions that made them.

    :param policy: the policy as it was given: a preset or key-grammar spec, or the path of
        a policy TOML file (relative to the lock file's folder once written).
    :param resolved: ``str()`` of the resolved policy.
    :param backend: the backend's name (``"torch"``).
    :param device: ``"cpu"`` or ``"cuda"``.
    :param lowp: the low-precision input dtype the ops were resolved for.
    :param native: what the framework's native answers describe
        (``"torch.autocast('cpu', dtype=torch.bfloat16)"``), or ``""`` when none were recorded.
    :param versions: ``mixprec``, ``python`` and the framework's distribution name, each to
        its version.
    :param ops: op name to :class:`OpLock`.
    """

    policy: str
    resolved: str
    backend: str
    device: str
    lowp: str
    native: str
    versions: dict[str, str]
    ops: dict[str, OpLock] = field(default_factory=dict)

    def checksum(self) -> str:
        """``sha256:<hex>`` of everything the lock records (the file carries it)."""
        body = {
            "lock": {key: getattr(self, key) for key in _HEADER_KEYS if key != "format"},
            "versions": self.versions,
            "ops": {name: op.fields() for name, op in self.ops.items()},
        }
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()

    def to_toml(self) -> str:
        """The lock file's text (:func:`parse_lock` reads it back)."""
        header = (
            f"mixprec precision lock: what each op runs in under policy {self.resolved!r}\n"
            f"on the {self.backend} backend, device {self.device}. Check it with\n"
            "  mixprec lock --check FILE\n"
            "which exits 1 and names every op that resolves differently with what is installed."
        )
        data: dict[str, Any] = {
            "lock": {key: getattr(self, key) for key in _HEADER_KEYS if key != "format"},
            "versions": dict(self.versions),
            "ops": {name: op.fields() for name, op in sorted(self.ops.items())},
        }
        data["lock"] = {"format": FORMAT, **data["lock"], "checksum": self.checksum()}
        return toml_dumps(data, header=header)


def _toml() -> Any:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            raise LockError(
                "reading a lock file needs Python 3.11+ (tomllib) or `pip install tomli`"
            ) from None
    return tomllib


def _string(table: Mapping[str, Any], key: str, where: str, source: str) -> str:
    value = table.get(key)
    if not isinstance(value, str):
        got = "nothing" if value is None else repr(value)
        raise LockError(
            f"{source}: {where}.{key} must be a string, found {got}; the file is damaged or "
            "was edited by hand. Write it again with `mixprec lock POLICY --backend NAME -o FILE`"
        )
    return value


def _dtype(value: str, where: str, source: str, extra: tuple[str, ...]) -> str:
    if value not in (*POLICY_DTYPES, *extra):
        raise LockError(
            f"{source}: {where} is {value!r}, which is not a dtype ({', '.join(POLICY_DTYPES)}"
            f" or {' or '.join(extra)}); the file is damaged or was edited by hand. Write it "
            "again with `mixprec lock POLICY --backend NAME -o FILE`"
        )
    return value


def _table(data: Mapping[str, Any], key: str, source: str) -> Mapping[str, Any]:
    table = data.get(key)
    if not isinstance(table, Mapping):
        raise LockError(
            f"{source} has no [{key}] table, so it is not a complete mixprec precision lock "
            "(truncated, or another kind of file: a policy file is locked with `mixprec lock "
            "POLICY.toml --backend NAME -o FILE`)"
        )
    return table


def _op(name: str, entry: Any, source: str) -> OpLock:
    where = f"ops.{name}"
    if not isinstance(entry, Mapping):
        raise LockError(f"{source}: {where} must be a table of rule and dtypes, found {entry!r}")
    unknown = sorted(set(entry) - {"rule", "float32", "lowp", "native_float32", "native_lowp"})
    if unknown:
        raise LockError(f"{source}: {where} has unknown keys {unknown}; the file was edited")
    values = {key: _string(entry, key, where, source) for key in ("rule", "float32", "lowp")}
    for key in ("float32", "lowp"):
        _dtype(values[key], f"{where}.{key}", source, (BANNED,))
    native = {}
    for key in ("native_float32", "native_lowp"):
        if key in entry:
            native[key] = _dtype(_string(entry, key, where, source), f"{where}.{key}", source,
                                 (REFUSED,))  # fmt: skip
    return OpLock(**values, **native)


def _unknown(found: Mapping[str, Any], known: tuple[str, ...], where: str, source: str) -> None:
    extra = sorted(set(found) - set(known))
    if extra:
        raise LockError(
            f"{source}: {where} has {', '.join(map(repr, extra))}, which a lock does not hold "
            f"(it holds {', '.join(known)}), so the file was edited by hand or is not a "
            f"mixprec precision lock. {_WRITE_AGAIN}"
        )


def parse_lock(text: str, source: str = "the lock file") -> PrecisionLock:
    """The lock written as ``text`` (from :meth:`PrecisionLock.to_toml`).

    :param source: how to name the file in messages.
    :raises LockError: not TOML (or nested too deeply to read), a table or key missing (a
        truncated file), a table or key a lock does not hold or a value that is not what
        the lock writes (a hand edit), or another format.
    """
    tomllib = _toml()
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise LockError(
            f"{source} is not valid TOML ({err}): the file is damaged or truncated. " + _WRITE_AGAIN
        ) from None
    except RecursionError:
        raise LockError(
            f"{source} nests arrays or tables too deeply to read: it is not a mixprec precision "
            f"lock, which has two levels. {_WRITE_AGAIN}"
        ) from None
    head = _table(data, "lock", source)
    _unknown(data, _TABLES, "the file", source)
    _unknown(head, _LOCK_KEYS, "[lock]", source)
    found = head.get("format")
    if type(found) is not int or found != FORMAT:  # `format = true` equals 1 in Python
        raise LockError(
            f"{source} is lock format {found!r}; this mixprec reads format {FORMAT}. "
            "Write the lock again with this mixprec (`mixprec lock ... -o FILE`)"
        )
    versions = _table(data, "versions", source)
    ops = _table(data, "ops", source)
    if not ops:
        raise LockError(f"{source} locks no op: the file is truncated; write it again")
    header = {key: _string(head, key, "lock", source) for key in _HEADER_KEYS if key != "format"}
    _dtype(header["lowp"], "lock.lowp", source, ())
    lock = PrecisionLock(
        **header,
        versions={key: _string(versions, key, "versions", source) for key in versions},
        ops={name: _op(name, entry, source) for name, entry in ops.items()},
    )
    if _string(head, "checksum", "lock", source) != lock.checksum():
        raise LockError(
            f"{source} does not match its checksum: it was edited by hand, damaged or cut "
            "short. A lock records what mixprec resolved; write it again with `mixprec lock "
            "POLICY --backend NAME -o FILE` rather than editing it"
        )
    return lock


def read_lock_file(path: str | os.PathLike[str], *, max_bytes: int) -> PrecisionLock:
    """The lock in file ``path``, read only when it holds at most ``max_bytes`` (a path to
    ``/dev/zero`` or a huge file is refused after ``max_bytes + 1`` bytes, not read whole).

    :raises LockError: the file cannot be read, is too large, or is not a lock (see
        :func:`parse_lock`).
    """
    name = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as err:
        raise LockError(f"cannot read the lock file {name!r}: {err}") from None
    if len(data) > max_bytes:
        raise LockError(
            f"lock file {name!r} is larger than {max_bytes:,} bytes, which no precision lock "
            f"is (a few kilobytes of TOML): it is not a lock. Check the path, or write the "
            "lock with `mixprec lock POLICY --backend NAME -o FILE`"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise LockError(
            f"cannot read the lock file {name!r}: it is not UTF-8 text ({err}). {_WRITE_AGAIN}"
        ) from None
    return parse_lock(text, f"lock file {name!r}")


# ---------------------------------------------------------------------- what changed


def _versions(old: PrecisionLock, new: PrecisionLock) -> str:
    moved = [
        f"{name} {old.versions[name]} -> {new.versions[name]}"
        for name in new.versions
        if name in old.versions and old.versions[name] != new.versions[name]
    ]
    return ", ".join(moved) if moved else "same versions"


def _op_change(old: OpLock, new: OpLock) -> list[str]:
    said = []
    for lowp, float32, how in (
        ("lowp", "float32", ""),
        ("native_lowp", "native_float32", " natively"),
    ):
        low = (getattr(old, lowp) or "not recorded", getattr(new, lowp) or "not recorded")
        full = (getattr(old, float32) or "not recorded", getattr(new, float32) or "not recorded")
        if low[0] != low[1] and low == full:  # the same change for both inputs: say it once
            said.append(f"{low[0]} -> {low[1]}{how} for all inputs")
            continue
        if low[0] != low[1]:
            said.append(f"{low[0]} -> {low[1]}{how}")
        if full[0] != full[1]:
            said.append(f"{full[0]} -> {full[1]}{how} for float32 inputs")
    if not said and old.rule != new.rule:
        said.append(f"rule {old.rule!r} -> {new.rule!r}")
    return said


def changes(old: PrecisionLock, new: PrecisionLock) -> list[str]:
    """One line per op that resolves differently in ``new`` than in ``old`` (and one per
    changed policy, device or low-precision dtype), such as
    ``layer_norm: float32 -> bfloat16 (torch 2.13.0 -> 2.14.0)``; empty when nothing did."""
    why = _versions(old, new)
    lines = [
        f"{key}: {getattr(old, key)} -> {getattr(new, key)} ({why})"
        for key in ("resolved", "device", "lowp")
        if getattr(old, key) != getattr(new, key)
    ]
    for name in sorted(set(old.ops) | set(new.ops)):
        before, after = old.ops.get(name), new.ops.get(name)
        if before is None and after is not None:
            lines.append(f"{name}: not in the lock -> {after.lowp} ({why})")
        elif after is None and before is not None:
            lines.append(f"{name}: {before.lowp} -> no longer resolved ({why})")
        elif before is not None and after is not None:
            said = _op_change(before, after)
            if said:
                lines.append(f"{name}: {'; '.join(said)} ({why})")
    return lines
