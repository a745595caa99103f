"""The Trainer's step protocol, policy checks and checkpoints, beyond the conformance suite."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from mixprec.errors import (
    CheckpointError,
    MixprecWarning,
    StepOrderError,
    UnsupportedDtypeError,
    WrapError,
)
from mixprec.testing.faults import file_size_limit, leftovers
from mixprec_numpy import MLP, SGD, Trainer, master_params, state, unscale_

X = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
Y = np.array([0, 1, 2, 0, 1, 2, 0, 1])


def _trainer(policy: str) -> tuple[MLP, Trainer]:
    model = MLP([4, 5, 3])
    return model, Trainer(model, SGD(lr=0.1, momentum=0.9), policy=policy)


def test_step_without_backward_names_the_missing_call() -> None:
    model, trainer = _trainer("O2")
    with pytest.raises(StepOrderError, match="before any scaled backward"):
        trainer.step()
    model.loss(X, Y)
    trainer.backward()
    trainer.unscale_()
    with pytest.raises(StepOrderError, match="already been called"):
        trainer.unscale_()


def test_o2_keeps_float16_params_and_float32_masters() -> None:
    model, trainer = _trainer("O2")
    assert {p.dtype for p in model.parameters()} == {"float16"}
    model.loss(X, Y)
    trainer.backward()
    assert not trainer.step()
    for param, master in trainer.masters.pairs:
        np.testing.assert_array_equal(param.data, master.data.astype(np.float16))


def test_auto_resolves_to_float32_with_a_warning() -> None:
    with pytest.warns(MixprecWarning):
        _, trainer = _trainer("auto")
    assert trainer.policy.compute == "float32"


def test_unsupported_dtype_and_scaler_without_masters_are_refused() -> None:
    with pytest.raises(UnsupportedDtypeError, match="float8"):
        _trainer("base=O1,compute=float8_e5m2")
    with pytest.raises(WrapError):
        _trainer("base=O3,loss_scale=dynamic")


def test_checkpoint_from_another_policy_is_refused() -> None:
    _, o2 = _trainer("O2")
    buffer = io.BytesIO()
    o2.save(buffer)
    buffer.seek(0)
    _, bf16 = _trainer("O2-bf16")
    with pytest.raises(CheckpointError, match="different policy"):
        bf16.load(buffer)


def test_skipped_step_records_the_overflowing_parameter_and_loop_functions_work() -> None:
    model, trainer = _trainer("O2")
    model.loss(X, Y)
    trainer.backward()
    param = trainer.masters.pairs[0][0]
    param.grad[0, 0] = np.inf  # an overflow in one parameter only
    unscale_(trainer)  # the built-in backends' name, taking the trainer
    assert {m.dtype for m in master_params(trainer)} == {"float32"}
    assert trainer.step() is True
    assert [(r.step, r.params) for r in trainer.overflows] == [(0, (param.name,))]  # 0-based
    assert state(trainer).skipped_steps == 1


# ---------------------------------------------------------------------- issue 21


def _trained(policy: str = "O2") -> tuple[MLP, Trainer]:
    model, trainer = _trainer(policy)
    for _ in range(2):
        model.loss(X, Y)
        trainer.backward()
        trainer.step()
    return model, trainer


def _everything(trainer: Trainer) -> dict[str, object]:
    return {
        "weights": [(p.data.copy(), m.data.copy()) for p, m in trainer.masters.pairs],
        "optimizer": {k: v.copy() for k, v in trainer.optimizer.state.items()},
        "scaler": trainer.scaler.state_dict(),
    }


def _same(a: dict[str, object], b: dict[str, object]) -> bool:
    return repr(a) == repr(b) and all(
        np.array_equal(x, y)
        for (pa, ma), (pb, mb) in zip(a["weights"], b["weights"], strict=True)  # type: ignore[arg-type]
        for x, y in ((pa, pb), (ma, mb))
    )


def _edited(trainer: Trainer, edit: str) -> io.BytesIO:
    """A checkpoint of ``trainer`` with every weight moved and one thing wrong."""
    buffer = io.BytesIO()
    trainer.save(buffer)
    buffer.seek(0)
    with np.load(buffer, allow_pickle=False) as saved:
        arrays = {name: saved[name] for name in saved.files}
    meta = json.loads(str(arrays["meta"]))
    for name in list(arrays):
        if name.startswith("param/"):
            arrays[name] = arrays[name] + 1
    if edit == "steps=-1":
        meta["scaler"]["steps"] = -1
    elif edit == "inf counter":
        meta["scaler"]["skipped_steps"] = float("inf")
    elif edit == "nan momentum":
        name = next(n for n in arrays if n.startswith("optimizer/"))
        arrays[name] = np.full_like(arrays[name], np.nan)
    elif edit == "missing weight":
        del arrays[next(n for n in arrays if n.startswith("param/"))]
    arrays["meta"] = np.array(json.dumps(meta))
    out = io.BytesIO()
    np.savez(out, **arrays)
    out.seek(0)
    return out


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("steps=-1", "not a non-negative whole number"),
        ("inf counter", "not a non-negative whole number"),
        ("nan momentum", "inf or NaN"),
        ("missing weight", "no matching weight"),
    ],
)
def test_a_refused_load_changes_nothing(edit: str, message: str) -> None:
    """Trainer.load applied the weights and the optimizer state, then rejected steps=-1."""
    _, trainer = _trained()
    checkpoint = _edited(trainer, edit)
    before = _everything(trainer)
    with pytest.raises(CheckpointError, match=message):
        trainer.load(checkpoint)
    assert _same(_everything(trainer), before)


def test_a_damaged_file_is_a_checkpoint_error() -> None:
    _, trainer = _trained()
    buffer = io.BytesIO()
    trainer.save(buffer)
    with pytest.raises(CheckpointError, match="cannot read the checkpoint"):
        trainer.load(io.BytesIO(buffer.getvalue()[: len(buffer.getvalue()) // 2]))


def test_saves_are_atomic_and_keep_numpys_file_name(tmp_path: Path) -> None:
    _, trainer = _trained()
    trainer.save(tmp_path / "ckpt")  # np.savez adds .npz to a path
    trainer.save_parameters(str(tmp_path / "weights.npz"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.npz", "weights.npz"]
    old = (tmp_path / "ckpt.npz").read_bytes()
    with file_size_limit(len(old) // 2), pytest.raises(OSError):
        trainer.save(tmp_path / "ckpt.npz")  # the disk "fills" half-way
    assert (tmp_path / "ckpt.npz").read_bytes() == old
    assert leftovers(tmp_path, "ckpt.npz") == []
    _, fresh = _trainer("O2")
    fresh.load(tmp_path / "ckpt.npz")
    assert _same(_everything(fresh), _everything(trainer))
