"""States files that were damaged on disk or edited (issue 37): NaN or float16 optimizer
state is refused like torch's loader refuses it, the format carries a SHA-256 checksum so
a flipped byte is refused instead of loading changed numbers, and sizes are checked before
anything is read whole. Found by loading edited files and by flipping bytes of a real one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

from _mx_nets import batch, mlp, rewrite_states, train_step, values  # noqa: E402
from mxnet import gluon, nd  # noqa: E402

from mixprec.errors import CheckpointError  # noqa: E402
from mixprec_mxnet import Trainer  # noqa: E402
from mixprec_mxnet.step.state_files import FORMAT_V2  # noqa: E402

pytestmark = pytest.mark.mxnet

L2 = gluon.loss.L2Loss()


def _trained(steps: int = 2, policy: str = "O2-bf16") -> tuple[Any, Trainer]:
    net = mlp()
    trainer = Trainer(net, "adam", {"learning_rate": 0.01}, policy=policy)
    x, y = batch()
    for _ in range(steps):
        train_step(net, trainer, x, y, L2)
    return net, trainer


def _state(trainer: Trainer) -> dict[Any, list[np.ndarray]]:
    return {k: [a.asnumpy() for a in v] for k, v in trainer._updaters[0].states.items()}


def _snapshot(net: Any, trainer: Trainer) -> tuple[Any, ...]:
    opt = trainer._optimizer
    return (
        {k: v.tobytes() for k, v in values(net).items()},
        trainer.loss_scale,
        trainer.scaler.steps,
        opt.num_update,
        dict(opt._index_update_count),
        {k: [a.tobytes() for a in v] for k, v in _state(trainer).items()},
    )


def _first_moment(meta: dict[str, Any]) -> str:
    return str(meta["per_param"]["0"]["tuple"][0]["array"])


def _nan_moment(meta: dict[str, Any], saved: dict[str, Any]) -> None:
    key = _first_moment(meta)
    bad = saved[key].asnumpy()
    bad.flat[0] = np.nan
    saved[key] = nd.array(bad)


def _float16_moment(meta: dict[str, Any], saved: dict[str, Any]) -> None:
    key = _first_moment(meta)
    saved[key] = saved[key].astype("float16")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_nan_moment, r"inf or NaN in the optimizer state of parameter '0\.bias' \(state 0\)"),
        (_float16_moment, r"float16 optimizer state \(parameter '0\.bias', state 0\)"),
    ],
    ids=["nan", "float16"],
)
def test_nan_or_float16_moments_are_refused_and_change_nothing(
    tmp_path: Path, edit: Any, message: str
) -> None:
    _, trainer = _trained(3)
    path = tmp_path / "t.states"
    trainer.save_states(str(path))
    rewrite_states(path, edit)  # re-sealed: the checksum holds, the content does not
    net, fresh = _trained(1)
    before = _snapshot(net, fresh)
    with pytest.raises(CheckpointError, match=message) as caught:
        fresh.load_states(str(path))
    assert "parameter '0." in str(caught.value)  # the entry, by its structural name
    assert "load" in str(caught.value)  # the fix
    assert _snapshot(net, fresh) == before


def test_every_flipped_byte_is_refused_or_changes_nothing(tmp_path: Path) -> None:
    """Flip every byte of a real states file (XOR 0xFF, and the lowest bit on a dense
    sample): each load is a CheckpointError or leaves bit-identical state."""
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(3, in_units=2))
    net.initialize(mx.init.Xavier(), force_reinit=True)
    trainer = Trainer(net, "adam", {"learning_rate": 0.01}, policy="O2-bf16")
    x, y = nd.ones((4, 2)), nd.zeros((4, 3))
    train_step(net, trainer, x, y, L2)
    path = tmp_path / "t.states"
    trainer.save_states(str(path))
    good = path.read_bytes()
    expected = _snapshot(net, trainer)
    damaged = tmp_path / "d.states"
    flips = [(i, 0xFF) for i in range(len(good))] + [(i, 0x01) for i in range(0, len(good), 3)]
    refused = 0
    for i, mask in flips:
        raw = bytearray(good)
        raw[i] ^= mask
        damaged.write_bytes(bytes(raw))
        try:
            trainer.load_states(str(damaged))
        except CheckpointError:
            refused += 1
        assert _snapshot(net, trainer) == expected, (i, mask)
    assert refused == len(flips)  # the checksum covers every byte


def test_a_states_file_of_the_previous_version_still_loads(tmp_path: Path) -> None:
    net, trainer = _trained(3)
    expected = _snapshot(net, trainer)
    path = tmp_path / "t.states"
    trainer.save_states(str(path))

    def as_v2(header: dict[str, Any], saved: dict[str, Any]) -> None:
        header["format"] = FORMAT_V2

    rewrite_states(path, as_v2)  # no checksum line, as /2 files are
    assert not path.read_bytes().endswith(b"\n")
    trainer.load_states(str(path))
    assert _snapshot(net, trainer) == expected
    # a /3 header without its checksum line is a truncated file
    good = tmp_path / "g.states"
    trainer.save_states(str(good))
    good.write_bytes(good.read_bytes()[:-81])
    with pytest.raises(CheckpointError, match="without its checksum line"):
        trainer.load_states(str(good))


def test_a_name_that_is_not_utf8_is_a_checkpoint_error(tmp_path: Path) -> None:
    """An unsealed (/2-style) file whose array name bytes are not UTF-8: MXNet's loader
    decodes the names itself, which raised a raw UnicodeDecodeError."""
    nd.save(str(tmp_path / "n.states"), {"optimizer/0/0": nd.ones((2,))})
    raw = (tmp_path / "n.states").read_bytes().replace(b"optimizer", b"\xffptimizer")
    (tmp_path / "n.states").write_bytes(raw)
    _, trainer = _trained(1)
    with pytest.raises(CheckpointError, match="not a readable trainer states file"):
        trainer.load_states(str(tmp_path / "n.states"))


def test_sizes_are_checked_before_the_file_is_read(tmp_path: Path) -> None:
    _, trainer = _trained(1)
    if os.path.exists("/dev/zero"):
        with pytest.raises(CheckpointError, match="not a regular file"):
            trainer.load_states("/dev/zero")
    huge = tmp_path / "huge.states"
    with open(huge, "wb") as f:
        f.truncate(64 << 20)  # sparse: no disk used
    with pytest.raises(CheckpointError, match="more than the states"):
        trainer.load_states(str(huge))
