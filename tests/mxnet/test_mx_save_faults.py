"""Saves that are killed or fail half-way keep the previous file; refused loads change nothing."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

from _mx_nets import batch, master_values, mlp, rewrite_states, train_step, values  # noqa: E402
from mxnet import gluon, nd  # noqa: E402

from mixprec.errors import CheckpointError  # noqa: E402
from mixprec.testing.faults import file_size_limit, kill_while_saving, leftovers  # noqa: E402
from mixprec_mxnet import Trainer  # noqa: E402

pytestmark = [
    pytest.mark.mxnet,
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX faults"),
]
L2 = gluon.loss.L2Loss()


def _trained(steps: int = 2) -> tuple[gluon.Block, Trainer]:
    net = mlp()
    trainer = Trainer(net, "adam", {"learning_rate": 0.01}, policy="O2-bf16",
                      loss_scale="dynamic(init=1024,interval=1)")  # fmt: skip
    x, y = batch()
    for _ in range(steps):
        train_step(net, trainer, x, y, L2)
    return net, trainer


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("saver", ["net.save_parameters", "trainer.save_parameters"])
def test_a_parameter_save_failing_half_way_keeps_the_previous_file(
    saver: str, tmp_path: Path
) -> None:
    net, trainer = _trained()
    path = str(tmp_path / "net.params")
    save = net.save_parameters if saver.startswith("net") else trainer.save_parameters
    save(path)
    before = {k: v.asnumpy() for k, v in nd.load(path).items()}
    x, y = batch(seed=1)
    train_step(net, trainer, x, y, L2)
    with file_size_limit(200), pytest.raises((OSError, mx.base.MXNetError)):
        save(path)
    assert _same({k: v.asnumpy() for k, v in nd.load(path).items()}, before)
    assert leftovers(tmp_path, "net.params") == []


def test_a_states_save_failing_half_way_keeps_the_previous_file(tmp_path: Path) -> None:
    net, trainer = _trained()
    path = str(tmp_path / "trainer.states")
    trainer.save_states(path)
    before = Path(path).read_bytes()
    x, y = batch(seed=1)
    train_step(net, trainer, x, y, L2)
    with file_size_limit(100), pytest.raises(OSError):
        trainer.save_states(path)
    assert Path(path).read_bytes() == before
    assert leftovers(tmp_path, "trainer.states") == []
    _, resumed = _trained(0)
    resumed.load_states(path)


@pytest.mark.slow
def test_a_kill_during_saves_leaves_loadable_files(tmp_path: Path) -> None:
    params, states = str(tmp_path / "big.params"), str(tmp_path / "big.states")
    # about 9 MB of parameters, so a save takes long enough to be killed in the middle
    script = textwrap.dedent(f"""
        import mxnet as mx
        from mxnet import gluon
        from mixprec_mxnet import Trainer
        net = gluon.nn.Dense(1500, in_units=1500)
        net.initialize()
        trainer = Trainer(net, "adam", {{"learning_rate": 0.01}}, policy="O2-bf16")
        net.save_parameters({params!r}); trainer.save_states({states!r})
        print("ready", flush=True)
        while True:
            net.save_parameters({params!r}); trainer.save_states({states!r})
    """)
    for delay in (0.2, 0.45, 0.7):
        kill_while_saving(script, delay)
        net = gluon.nn.Dense(1500, in_units=1500)
        net.initialize()
        trainer = Trainer(net, "adam", {"learning_rate": 0.01}, policy="O2-bf16")
        net.load_parameters(params)
        trainer.load_states(states)


def test_loading_a_file_with_an_unknown_key_changes_no_parameter(tmp_path: Path) -> None:
    net, trainer = _trained()
    other, _ = _trained(0)
    path = str(tmp_path / "net.params")
    saved = {k: v.copy() for k, v in nd.load(_save(other, tmp_path)).items()}
    saved["9.weight"] = nd.zeros((2, 2))  # a key this net does not have, saved last
    nd.save(path, saved)
    before, masters = values(net), master_values(trainer, net)
    with pytest.raises(CheckpointError, match=r"'9\.weight'.*ignore_extra=True"):
        net.load_parameters(path)
    assert _same(values(net), before) and _same(master_values(trainer, net), masters)


def test_loading_a_file_with_a_wrong_shape_changes_no_parameter(tmp_path: Path) -> None:
    net, _trainer = _trained()
    other, _ = _trained(0)
    saved = dict(nd.load(_save(other, tmp_path)))
    saved["1.bias"] = nd.zeros((5,))
    path = str(tmp_path / "net.params")
    nd.save(path, saved)
    before = values(net)
    with pytest.raises(CheckpointError, match="shape"):
        net.load_parameters(path)
    assert _same(values(net), before)


def test_a_truncated_parameter_file_is_a_checkpoint_error(tmp_path: Path) -> None:
    net, _ = _trained()
    path = Path(_save(net, tmp_path))
    path.write_bytes(path.read_bytes()[:300])
    before = values(net)
    with pytest.raises(CheckpointError, match="truncated or damaged"):
        net.load_parameters(str(path))
    assert _same(values(net), before)


@pytest.mark.parametrize("damage", ["truncated", "bad scaler", "bad optimizer state"])
def test_a_damaged_states_file_changes_neither_the_scale_nor_the_state(
    damage: str, tmp_path: Path
) -> None:
    _net, trainer = _trained(3)
    path = tmp_path / "trainer.states"
    trainer.save_states(str(path))
    raw = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    else:

        def edit(header: dict[str, Any], arrays: dict[str, Any]) -> None:
            if damage == "bad scaler":
                header["scaler"] = dict(header["scaler"], steps="many")
            else:
                header["per_param"] = {"99": None}

        rewrite_states(path, edit)
    _fresh_net, fresh = _trained(0)
    scale, steps = fresh.loss_scale, fresh.scaler.steps
    state = fresh._updaters[0].get_states(dump_optimizer=False)
    with pytest.raises(CheckpointError):
        fresh.load_states(str(path))
    assert (fresh.loss_scale, fresh.scaler.steps) == (scale, steps)
    assert fresh._updaters[0].get_states(dump_optimizer=False) == state


def _save(net: gluon.Block, folder: Path) -> str:
    path = str(folder / "other.params")
    net.save_parameters(path)
    return path


def test_an_export_failing_half_way_keeps_the_previous_files(tmp_path: Path) -> None:
    net, trainer = _trained()
    net.hybridize()
    x, y = batch()
    train_step(net, trainer, x, y, L2)
    prefix = str(tmp_path / "model")
    net.export(prefix)
    files = [Path(f"{prefix}-symbol.json"), Path(f"{prefix}-0000.params")]
    before = [f.read_bytes() for f in files]
    train_step(net, trainer, x, y, L2)
    with file_size_limit(100), pytest.raises(OSError):
        net.export(prefix)
    assert [f.read_bytes() for f in files] == before
    assert leftovers(tmp_path, files[0].name) == leftovers(tmp_path, files[1].name) == []
