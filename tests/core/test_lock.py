"""The precision lockfile, on the NumPy plugin's backend: a lock then a check is clean, a
changed policy or framework is named op by op with the versions, and a damaged, cut, edited
or foreign lock is refused with exit code 2 (no traceback)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

import mixprec
from mixprec import lock as locking
from mixprec.backend import NativeDtypes
from mixprec.cli import main
from mixprec.engine import plugins
from mixprec.errors import BackendNotAvailable, LockError, PolicyError
from mixprec.policy.ops import OP_FAMILIES

pytest.importorskip("mixprec_numpy")  # the NumPy plugin's backend is the one locked here

pytestmark = pytest.mark.usefixtures("fresh_plugins")


def test_a_lock_records_every_op_versions_device_and_rules_and_checks_clean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "precision.lock"
    lock = mixprec.write_lock("O1", "numpy", path)
    assert set(OP_FAMILIES) <= set(lock.ops) and path.read_text() == lock.to_toml()
    assert lock.versions["mixprec"] == mixprec.__version__
    assert set(lock.versions) == {"mixprec", "numpy", "python"}
    assert (lock.backend, lock.device, lock.lowp) == ("numpy", "cpu", "float16")
    policy = mixprec.get_policy("O1")
    for op in ("linear", "softmax", "relu", "add"):
        decided = policy.decide(op, ["float16"])
        assert (lock.ops[op].lowp, lock.ops[op].rule) == (decided.dtype, decided.rule)
        assert lock.ops[op].float32 == policy.decide(op, ["float32"]).dtype
    assert lock.ops["binary_cross_entropy"].lowp == "banned"
    # NumPy's own type rules for what O1 passes through: float16 stays float16
    assert (lock.ops["relu"].native_float32, lock.ops["relu"].native_lowp) == (
        "float32",
        "float16",
    )
    assert lock.ops["linear"].native_lowp is None  # decided by the policy, not NumPy
    assert locking.read_lock(path) == lock
    result = mixprec.check_lock(path)
    assert result.ok and result.changes == [] and result.now == lock
    assert main(["lock", "--check", str(path)]) == 0
    assert "every op resolves as locked" in capsys.readouterr().out


def test_a_changed_policy_file_is_named_op_by_op(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = tmp_path / "policies" / "mine.toml"
    policy.parent.mkdir()
    policy.write_text('base = "O1-bf16"\n')
    out = tmp_path / "locks" / "mine.lock"
    assert main(["lock", str(policy), "--backend", "numpy", "-o", str(out)]) == 0
    assert f"{len(OP_FAMILIES)} ops of 'O1-bf16' locked" in capsys.readouterr().out
    assert locking.read_lock(out).policy == "../policies/mine.toml"  # relative to the lock
    policy.write_text('base = "O1-bf16"\nmove_ops = { lowp = ["layer_norm"] }\n')
    result = mixprec.check_lock(out)
    assert result.changes == [
        "resolved: O1-bf16 -> base=O1-bf16,lowp+=layer_norm (same versions)",
        "layer_norm: float32 -> bfloat16 for all inputs (same versions)",
    ]
    assert main(["lock", "--check", str(out)]) == 1
    assert capsys.readouterr().out.splitlines()[:2] == result.changes


class _NextNumpy:
    """Answers the lockfile's hook as a later NumPy would: relu computes in float32."""

    @mixprec.hookimpl(tryfirst=True)
    def mixprec_native_dtypes(self, backend: str, device: str, compute: str) -> Any:
        if backend != "numpy":
            return None
        answer = mixprec.load_backend("numpy").native_dtypes(device, compute)
        dtypes = {**answer.dtypes, "relu": {"float32": "float32", compute: "float32"}}
        return NativeDtypes(answer.source, dtypes)


def test_a_framework_upgrade_is_named_with_the_versions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "o1.lock"
    locked = mixprec.write_lock("O1", "numpy", path)
    installed = locking._version
    monkeypatch.setattr(locking, "_version", lambda d: "9.9.0" if d == "numpy" else installed(d))
    plugins.register(_NextNumpy(), name="next-numpy")
    result = mixprec.check_lock(path)
    was = locked.versions["numpy"]
    assert result.changes == [f"relu: float16 -> float32 natively (numpy {was} -> 9.9.0)"]
    assert main(["lock", "--check", str(path)]) == 1
    assert capsys.readouterr().out.strip() == result.changes[0]


def _written(tmp_path: Path) -> Path:
    path = tmp_path / "o1.lock"
    mixprec.write_lock("O1", "numpy", path)
    return path


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda p: p.write_text("not [ a lock"), "not valid TOML"),
        (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "TOML|checksum"),
        (lambda p: p.write_text("\n".join(p.read_text().splitlines()[:40]) + "\n"), "checksum"),
        (lambda p: p.write_text('base = "O1"\n'), "no \\[lock\\] table"),
        (lambda p: _edit(p, 'lowp = "float32" }', 'lowp = "bfloat16" }'), "edited by hand"),
        (lambda p: _edit(p, 'lowp = "float32" }', 'lowp = "bfloat17" }'), "not a dtype"),
        (lambda p: _edit(p, 'backend = "numpy"', 'backend = "torch"'), "checksum"),
        (lambda p: _edit(p, "format = 1", "format = 7"), "format 7"),
        (lambda p: p.write_bytes(b"\xff\xfe\x00"), "cannot read"),
    ],
    ids=[
        "garbage",
        "cut",
        "cut-at-a-line",
        "a-policy",
        "edited",
        "no-dtype",
        "backend",
        "format",
        "binary",
    ],
)
def test_a_damaged_cut_or_edited_lock_is_refused(
    tmp_path: Path, damage: Any, match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _written(tmp_path)
    damage(path)
    with pytest.raises(LockError, match=match):
        mixprec.check_lock(path)
    assert main(["lock", "--check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mixprec: error: ") and "Traceback" not in err


def test_a_lock_from_another_backend_an_unknown_policy_or_backend_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _written(tmp_path)
    with pytest.raises(LockError, match="for the numpy backend, not torch"):
        mixprec.check_lock(path, backend="torch")
    assert main(["lock", "--check", str(path), "--backend", "torch"]) == 2
    with pytest.raises(PolicyError, match="O7"):
        mixprec.write_lock("O7", "numpy", tmp_path / "x.lock")
    with pytest.raises(BackendNotAvailable, match="jax"):
        mixprec.write_lock("O1", "jax", tmp_path / "x.lock")
    assert main(["lock", "O7", "--backend", "numpy", "-o", str(tmp_path / "x.lock")]) == 2
    assert main(["lock", "O1"]) == 2  # no backend
    assert main(["lock", "O1", "--check", str(path)]) == 2  # both
    err = capsys.readouterr().err
    assert "Traceback" not in err and "needs POLICY and --backend" in err
    assert not (tmp_path / "x.lock").exists()
    gone = tmp_path / "gone.toml"
    gone.write_text('base = "O1"\n')
    mixprec.write_lock(gone, "numpy", tmp_path / "gone.lock")
    gone.unlink()
    with pytest.raises(PolicyError, match=r"gone\.toml"):
        mixprec.check_lock(tmp_path / "gone.lock")


def test_a_policy_object_and_auto_lock_as_their_resolved_policy(tmp_path: Path) -> None:
    policy = mixprec.get_policy("O2-bf16").with_module("head", "float32", match="path")
    lock = locking.make_lock(policy, "numpy")
    assert lock.policy == lock.resolved == str(policy) and lock.native == ""  # O2 casts no op
    assert all(op.native_lowp is None for op in lock.ops.values())
    with pytest.warns(mixprec.MixprecWarning, match="float32"):  # nothing is fast in NumPy
        auto = locking.make_lock("auto", "numpy")
    assert auto.resolved == "O0"
    assert dataclasses.replace(auto, policy="O0") == locking.make_lock("O0", "numpy")


# ---------------------------------------------------------------------- issue 37: files


def _one_line_refusal(err: str, *words: str) -> None:
    assert err.startswith("mixprec: error: ") and "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    for word in words:
        assert word in err, err


def test_check_of_dev_zero_is_refused_after_the_size_cap_not_read_until_memory_runs_out(
    tmp_path: Path,
) -> None:
    """``mixprec lock --check /dev/zero`` read until memory ran out: run as found, as a
    command, under a 1 GiB address-space limit (without the cap it dies of MemoryError)."""
    import resource
    import subprocess
    import sys

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    done = subprocess.run(
        [sys.executable, "-m", "mixprec", "lock", "--check", "/dev/zero"],
        capture_output=True, text=True, timeout=120, preexec_fn=limit, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    _one_line_refusal(done.stderr, "/dev/zero", "larger than")


def test_a_lock_file_is_capped_like_a_policy_file(tmp_path: Path) -> None:
    from mixprec.engine.spec import MAX_POLICY_BYTES

    path = _written(tmp_path)
    text = path.read_text()
    path.write_text(text + "#" * (MAX_POLICY_BYTES - len(text.encode())))  # at the cap: read
    assert mixprec.check_lock(path).ok
    path.write_text(text + "#" * (MAX_POLICY_BYTES + 1 - len(text.encode())))
    with pytest.raises(LockError, match="larger than 1,048,576 bytes"):
        mixprec.check_lock(path)


def test_a_lock_nested_3000_deep_is_a_lock_error_not_a_recursion_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "deep.lock"
    path.write_text("x = " + "[" * 3000 + "]" * 3000 + "\n")
    with pytest.raises(LockError, match="too deeply"):
        mixprec.check_lock(path)
    assert main(["lock", "--check", str(path)]) == 2
    _one_line_refusal(capsys.readouterr().err, "too deeply")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda p: _edit(p, "format = 1", "format = true"), "format True"),
        (lambda p: _edit(p, "format = 1", "format = 1.0"), "format 1.0"),
        (lambda p: _edit(p, "format = 1\n", 'format = 1\nsigned_off = "me"\n'), "'signed_off'"),
        (lambda p: p.write_text(p.read_text() + "\n[extra]\nnote = 1\n"), "'extra'"),
        (lambda p: p.write_text('comment = "hi"\n' + p.read_text()), "'comment'"),
    ],
    ids=["format-true", "format-float", "lock-key", "table", "top-level-key"],
)
def test_what_is_outside_the_checksum_is_refused_not_ignored(
    tmp_path: Path, edit: Any, match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``format = true`` (equal to 1 in Python) and unknown keys and tables were accepted:
    nothing outside the checksum may change what the file says."""
    path = _written(tmp_path)
    edit(path)
    with pytest.raises(LockError, match=match):
        mixprec.check_lock(path)
    assert main(["lock", "--check", str(path)]) == 2
    _one_line_refusal(capsys.readouterr().err)


def test_check_with_another_device_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--device`` was ignored by ``lock --check``: a cpu lock checked "clean" for cuda."""
    path = _written(tmp_path)
    assert main(["lock", "--check", str(path), "--device", "cpu"]) == 0
    capsys.readouterr()
    assert main(["lock", "--check", str(path), "--device", "cuda"]) == 2
    _one_line_refusal(capsys.readouterr().err, "for device cpu, not cuda", "--device cpu")
    with pytest.raises(LockError, match="for device cpu, not cuda"):
        mixprec.check_lock(path, device="cuda")


@pytest.mark.parametrize("where", ["folder", "empty", "proc", "fifo", "under-a-file"])
def test_output_no_lock_can_be_written_to_is_one_line_and_exit_2(
    tmp_path: Path, where: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``lock -o`` a folder, ``''`` or ``/proc/...`` were tracebacks from mixprec/atomic.py."""
    import os

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    (work / "a-file").write_text("x")
    if where == "fifo":
        os.mkfifo(work / "pipe")
    target = {
        "folder": str(work),
        "empty": "",
        "proc": f"/proc/{os.getpid()}/precision.lock",
        "fifo": str(work / "pipe"),
        "under-a-file": str(work / "a-file" / "precision.lock"),
    }[where]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert main(["lock", "O1", "--backend", "numpy", "-o", target]) == 2
    _one_line_refusal(capsys.readouterr().err, "cannot write the lock file", "-o")
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    with pytest.raises(LockError, match="cannot write the lock file"):
        mixprec.write_lock("O1", "numpy", target)


# ---------------------------------------------------------------------- the reader, unit by unit
# (what the mutation tester found no test pinning down: docs/reliability.md, "Mutation testing")


def _small_lock(**ops: Any) -> Any:
    from mixprec.policy.lockfile import OpLock, PrecisionLock

    return PrecisionLock(
        policy="O1",
        resolved="O1",
        backend="numpy",
        device="cpu",
        lowp="float16",
        native="numpy's type rules",
        versions={"mixprec": "1.0", "numpy": "2.0", "python": "3.11"},
        ops=ops or {"relu": OpLock("passthrough", "float32", "float16", "float32", "refused")},
    )


def test_the_checksum_of_a_known_lock_never_changes() -> None:
    """Locks written by this format must verify in every later mixprec: the checksum's text
    (keys, separators, prefix) is pinned to its value."""
    assert _small_lock().checksum() == (
        "sha256:6849566a5b8d8a31393698180e0593ff89a758b0ee0c2c4454d63f6d5872152b"
    )


def test_a_native_refusal_round_trips_and_locks_are_frozen() -> None:
    import dataclasses as dc

    from mixprec.policy.lockfile import parse_lock

    lock = _small_lock()
    assert parse_lock(lock.to_toml()) == lock
    assert parse_lock(lock.to_toml()).ops["relu"].native_lowp == "refused"
    with pytest.raises(dc.FrozenInstanceError):
        lock.device = "cuda"  # type: ignore[misc]
    with pytest.raises(dc.FrozenInstanceError):
        lock.ops["relu"].lowp = "float32"  # type: ignore[misc]


def _cut_line(text: str, start: str) -> str:
    at = text.index(start)
    return text[:at] + text[text.index("\n", at) + 1 :]


_REFUSALS: dict[str, tuple[Any, str]] = {
    "not-a-string": (
        lambda t: t.replace('policy = "O1"', "policy = 1"),
        "lock.policy must be a string, found 1",
    ),
    "missing": (lambda t: _cut_line(t, "device = "), "lock.device must be a string, found nothing"),
    "lowp": (
        lambda t: t.replace('lowp = "float16"\nnative', 'lowp = "bfloat17"\nnative'),
        "lock.lowp is 'bfloat17'",
    ),
    "version": (
        lambda t: t.replace('numpy = "2.0"', "numpy = 2"),
        "versions.numpy must be a string",
    ),
    "no-checksum": (
        lambda t: _cut_line(t, "checksum = "),
        "lock.checksum must be a string, found nothing",
    ),
    "no-op": (lambda t: t[: t.index("[ops]") + 6], "locks no op"),
    "op-not-a-table": (
        lambda t: t.replace("relu = {", 'relu = "float32"\nx = {'),
        "ops.relu must be a table",
    ),
    "op-key": (
        lambda t: t.replace("relu = { rule", 'relu = { extra = "1", rule'),
        "ops.relu has unknown keys ['extra']",
    ),
    "table": (lambda t: t + "\n[extra]\nnote = 1\n", "the file has 'extra'"),
    "lock-key": (
        lambda t: t.replace("format = 1\n", 'format = 1\nsigned_off = "me"\n'),
        "[lock] has 'signed_off'",
    ),
}


@pytest.mark.parametrize("case", list(_REFUSALS))
def test_each_refusal_names_the_key(case: str) -> None:
    from mixprec.policy.lockfile import parse_lock

    edit, says = _REFUSALS[case]
    text = _small_lock().to_toml()
    edited = edit(text)
    assert edited != text
    with pytest.raises(LockError) as caught:
        parse_lock(edited)
    assert says in str(caught.value) and str(caught.value).startswith("the lock file")


def test_a_missing_lock_file_cannot_be_read(tmp_path: Path) -> None:
    with pytest.raises(LockError, match="cannot read the lock file") as caught:
        mixprec.check_lock(tmp_path / "nowhere.lock")
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


def test_changes_name_each_kind_of_change_with_the_versions() -> None:
    from mixprec.policy.lockfile import OpLock, changes

    old = _small_lock(
        a=OpLock("r", "float32", "float16"),
        b=OpLock("r", "float32", "float16"),
        c=OpLock("r", "float32", "float16"),
        d=OpLock("r", "float32", "float16"),
        gone=OpLock("r", "float32", "float16"),
    )
    new = dataclasses.replace(
        old,
        versions={"mixprec": "1.1", "numpy": "2.1", "python": "3.11"},
        ops={
            "a": OpLock("r", "float32", "float32"),  # low-precision inputs only
            "b": OpLock("r", "float16", "float16"),  # float32 inputs only
            "c": OpLock("other rule", "float32", "float16"),  # only the rule
            "d": OpLock("r", "float32", "float16"),  # unchanged
            "new": OpLock("r", "float32", "bfloat16"),
        },
    )
    why = "(mixprec 1.0 -> 1.1, numpy 2.0 -> 2.1)"
    assert changes(old, new) == [
        f"a: float16 -> float32 {why}",
        f"b: float32 -> float16 for float32 inputs {why}",
        f"c: rule 'r' -> 'other rule' {why}",
        f"gone: float16 -> no longer resolved {why}",
        f"new: not in the lock -> bfloat16 {why}",
    ]
    assert changes(old, old) == []


def test_a_lock_records_the_optimizer_state_format_and_names_its_change(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = tmp_path / "train.toml"
    policy.write_text('base = "O2-bf16"\nstate = "int8"\n')
    out = tmp_path / "train.lock"
    assert main(["lock", str(policy), "--backend", "numpy", "-o", str(out)]) == 0
    assert locking.read_lock(out).resolved == "base=O2-bf16,state=int8"
    policy.write_text('base = "O2-bf16"\nstate = "int4(block=64)"\n')
    assert mixprec.check_lock(out).changes == [
        "resolved: base=O2-bf16,state=int8 -> base=O2-bf16,state=int4(block=64) (same versions)"
    ]
    capsys.readouterr()
