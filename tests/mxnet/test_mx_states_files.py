"""Trainer states files hold data, never code (issue 21): a crafted file runs nothing, files
saved by earlier mixprec versions and by plain ``gluon.Trainer`` still resume exactly, and a
file that does not fit (optimizer, schedule, shapes) changes nothing."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

from _mx_nets import batch, mlp, rewrite_states, states_header, train_step, values  # noqa: E402
from mxnet import gluon, nd  # noqa: E402

from mixprec.errors import CheckpointError, MixprecWarning  # noqa: E402
from mixprec_mxnet import Trainer  # noqa: E402

pytestmark = pytest.mark.mxnet

L2 = gluon.loss.L2Loss()
ADAM = {"learning_rate": 0.01}


def _trained(steps: int = 2, policy: str = "O2-bf16", **params: Any) -> tuple[Any, Trainer]:
    net = mlp()
    trainer = Trainer(net, "adam", dict(ADAM, **params), policy=policy)
    x, y = batch()
    for _ in range(steps):
        train_step(net, trainer, x, y, L2)
    return net, trainer


def _snapshot(net: Any, trainer: Trainer) -> tuple[Any, ...]:
    opt = trainer._optimizer
    return (
        values(net),
        trainer.loss_scale,
        trainer.scaler.steps,
        opt.num_update,
        dict(opt._index_update_count),
        {k: [a.asnumpy() for a in v] for k, v in trainer._updaters[0].states.items()},
    )


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    va, *ra, sa = a
    vb, *rb, sb = b
    same_values = va.keys() == vb.keys() and all(np.array_equal(va[k], vb[k]) for k in va)
    same_states = sa.keys() == sb.keys() and all(
        all(np.array_equal(x, y) for x, y in zip(sa[k], sb[k], strict=True)) for k in sa
    )
    return same_values and ra == rb and same_states


class _RunsCode:
    """Unpickling this calls ``open(marker, 'w')``: any code a pickle may run."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("where", ["file", "optimizer bytes"])
def test_a_crafted_states_file_runs_no_code(tmp_path: Path, where: str) -> None:
    """``load_states`` used to unpickle the file, then the optimizer bytes inside it while
    "validating": either could run code before the CheckpointError."""
    marker = str(tmp_path / "ran")
    net, trainer = _trained()
    before = _snapshot(net, trainer)
    evil = pickle.dumps(_RunsCode(marker))
    if where == "file":
        blob = evil
    else:
        blob = pickle.dumps(
            {
                "format": "mixprec-mxnet-states/1",
                "optimizer": evil,
                "scaler": trainer.scaler.state_dict(),
                "policy": trainer.policy.to_dict(),
            }
        )
    path = tmp_path / "evil.states"
    path.write_bytes(blob)
    with pytest.raises(CheckpointError, match=r"names io\.open, which mixprec never loads"):
        trainer.load_states(str(path))
    assert not os.path.exists(marker)
    assert _same(_snapshot(net, trainer), before)


def test_the_states_file_is_an_ndarray_file_with_a_json_header(tmp_path: Path) -> None:
    _net, trainer = _trained()
    path = tmp_path / "t.states"
    trainer.save_states(str(path))
    assert path.read_bytes()[:1] != b"\x80"  # not a pickle
    meta = states_header(path)
    assert meta["format"] == "mixprec-mxnet-states/3"
    assert meta["optimizer"]["class"] == "Adam"
    assert sorted(meta["names"]) == ["0.bias", "0.weight", "1.bias", "1.weight"]


def _legacy_v1(trainer: Trainer) -> bytes:
    """What save_states wrote before this format: a pickle with the updater's pickle inside."""
    names = ["0.weight", "0.bias", "1.weight", "1.bias"]
    by_param = {id(p): n for n, p in trainer._mixprec.net._collect_params_with_prefix().items()}
    return pickle.dumps(
        {
            "format": "mixprec-mxnet-states/1",
            "optimizer": trainer._updaters[0].get_states(dump_optimizer=True),
            "scaler": trainer.scaler.state_dict(),
            "policy": trainer.policy.to_dict(),
            "names": [by_param.get(id(p), p.name) for p in trainer._params] or names,
        }
    )


@pytest.mark.parametrize("kind", ["mixprec v1", "plain gluon.Trainer"])
def test_files_saved_the_old_ways_still_resume_exactly(tmp_path: Path, kind: str) -> None:
    schedule = {"lr_scheduler": mx.lr_scheduler.FactorScheduler(step=2, factor=0.5)}
    net, trainer = _trained(3, **schedule)
    net.save_parameters(str(tmp_path / "p.params"))
    path = tmp_path / "t.states"
    if kind == "mixprec v1":
        path.write_bytes(_legacy_v1(trainer))
    else:  # gluon.Trainer.save_states: the updater's pickle, optimizer included
        path.write_bytes(trainer._updaters[0].get_states(dump_optimizer=True))
    x, y = batch()
    for _ in range(3):
        train_step(net, trainer, x, y, L2)

    fresh, resumed = _trained(0, lr_scheduler=mx.lr_scheduler.FactorScheduler(step=2, factor=0.5))
    fresh.load_parameters(str(tmp_path / "p.params"))
    if kind == "mixprec v1":
        resumed.load_states(str(path))
    else:
        with pytest.warns(MixprecWarning, match="loss scale starts afresh"):
            resumed.load_states(str(path))
    assert resumed._optimizer.num_update == 3
    for _ in range(3):
        train_step(fresh, resumed, x, y, L2)
    expected, got = values(net), values(fresh)
    assert all(np.array_equal(expected[k], got[k]) for k in expected)
    assert resumed._optimizer.lr_scheduler.count == trainer._optimizer.lr_scheduler.count


def test_states_of_another_optimizer_or_schedule_change_nothing(tmp_path: Path) -> None:
    _, adam = _trained()
    path = str(tmp_path / "t.states")
    adam.save_states(path)
    net = mlp()
    sgd = Trainer(net, "sgd", {"learning_rate": 0.1, "momentum": 0.9}, policy="O2-bf16")
    before = _snapshot(net, sgd)
    with pytest.raises(CheckpointError, match=r"Adam optimizer.*SGD"):
        sgd.load_states(path)
    assert _same(_snapshot(net, sgd), before)
    _, scheduled = _trained(1, lr_scheduler=mx.lr_scheduler.FactorScheduler(step=2))
    scheduled.save_states(path)
    net, plain = _trained(1)
    before = _snapshot(net, plain)
    with pytest.raises(CheckpointError, match="lr_scheduler=FactorScheduler"):
        plain.load_states(path)
    assert _same(_snapshot(net, plain), before)


def _bad_shape(meta: dict[str, Any], saved: dict[str, Any]) -> None:
    key = meta["per_param"]["0"]["tuple"][0]["array"]
    saved[key] = nd.zeros((3, 3))


def _bad_counts(meta: dict[str, Any], saved: dict[str, Any]) -> None:
    meta["optimizer"]["counts"] = {"0": {"0": "many"}}


def _deep(meta: dict[str, Any], saved: dict[str, Any]) -> None:
    spec: Any = None
    for _ in range(50):
        spec = {"tuple": [spec]}
    meta["per_param"]["0"] = spec


@pytest.mark.parametrize("edit", [_bad_shape, _bad_counts, _deep], ids=lambda f: f.__name__)
def test_a_hostile_states_file_is_a_checkpoint_error_and_changes_nothing(
    tmp_path: Path, edit: Any
) -> None:
    _, trainer = _trained(3)
    path = tmp_path / "t.states"
    trainer.save_states(str(path))
    rewrite_states(path, edit)
    net, fresh = _trained(1)
    before = _snapshot(net, fresh)
    with pytest.raises(CheckpointError):
        fresh.load_states(str(path))
    assert _same(_snapshot(net, fresh), before)


def test_a_wrong_shape_loaded_before_the_masters_exist_changes_nothing(tmp_path: Path) -> None:
    """Before the Trainer made its masters (deferred shapes), Gluon's own loader ran and
    stopped half-way at a wrong shape, with an AssertionError."""
    net, _ = _trained(0)
    saved = dict(nd.load(_save(net, tmp_path)))
    saved["1.weight"] = nd.zeros((5, 16))  # Dense(4): 4 rows, whatever its input
    path = str(tmp_path / "wrong.params")
    nd.save(path, saved)
    fresh = gluon.nn.HybridSequential()
    fresh.add(gluon.nn.Dense(16, activation="relu"), gluon.nn.Dense(4))
    fresh.initialize(mx.init.Xavier())
    Trainer(fresh, "adam", ADAM, policy="O2-bf16")

    def state() -> dict[str, Any]:
        return {
            name: "deferred" if p._deferred_init else p.data().asnumpy()
            for name, p in fresh._collect_params_with_prefix().items()
        }

    before = state()
    assert before["0.weight"] == "deferred"
    with pytest.raises(CheckpointError, match=r"1\.weight.*shape"):
        fresh.load_parameters(path)
    after = state()
    assert after.keys() == before.keys()
    assert all(np.array_equal(after[k], v) for k, v in before.items())  # nothing loaded


def _save(net: Any, folder: Path) -> str:
    path = str(folder / "net.params")
    net.save_parameters(path)
    return path
