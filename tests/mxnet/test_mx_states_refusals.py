"""Each refusal of the states loader, one hostile file at a time (issue 37).

A states file that passes its checksum (re-sealed, as a writer of its own would) can still
hold anything: no header, a header that is not JSON, another format, optimizer state keyed
by something other than an index, an entry that is not in the file, nesting without end,
a quantized state that describes no array, an inf in the compensation. Each one is refused
with a :class:`~mixprec.errors.CheckpointError` that says what is wrong, and the Trainer
keeps its weights, loss scale and optimizer state. The descriptions of the optimizer state
are read by ``decode_state``, whose limits (nesting, a quantized array's shape) are pinned
on their boundaries.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

from _mx_nets import batch, mlp, rewrite_states, values  # noqa: E402
from mxnet import autograd, gluon, nd  # noqa: E402

from mixprec.errors import CheckpointError  # noqa: E402
from mixprec_mxnet import Trainer  # noqa: E402
from mixprec_mxnet.dtypes import cast  # noqa: E402
from mixprec_mxnet.lowbit.state import LowBitArray  # noqa: E402
from mixprec_mxnet.step.state_files import META, decode_state, seal  # noqa: E402

pytestmark = pytest.mark.mxnet

L2 = gluon.loss.L2Loss()
Edit = Callable[[dict[str, Any], dict[str, Any]], None]


def _trained(steps: int, policy: str = "O2-bf16") -> tuple[Any, Trainer]:
    net = mlp()
    trainer = Trainer(net, "adam", {"learning_rate": 0.01}, policy=policy)
    x, y = batch()
    if policy.startswith("O3"):  # the whole net in bfloat16: its inputs too
        x = cast(x, "bfloat16")
    for _ in range(steps):
        with autograd.record():
            loss = L2(cast(net(x), "float32"), y)
            with trainer.scale_loss(loss) as scaled:
                autograd.backward(scaled)
        trainer.step(x.shape[0])
    return net, trainer


def _snapshot(net: Any, trainer: Trainer) -> tuple[Any, ...]:
    opt = trainer._optimizer
    return (
        {k: v.tobytes() for k, v in values(net).items()},
        trainer.loss_scale,
        trainer.scaler.steps,
        opt.num_update,
        dict(opt._index_update_count),
        {k: [_bytes(a) for a in v] for k, v in trainer._updaters[0].states.items()},
    )


def _bytes(array: Any) -> Any:
    if isinstance(array, LowBitArray):  # state=int8: the codes as kept
        return (array.codes.asnumpy().tobytes(), array.absmax.asnumpy().tobytes(), array.shape)
    return array.asnumpy().tobytes()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], bytes]:
    """The bytes of a states file saved after three steps under ``policy`` (one per policy)."""
    folder = tmp_path_factory.mktemp("saved")
    files: dict[str, bytes] = {}

    def get(policy: str) -> bytes:
        if policy not in files:
            _, trainer = _trained(3, policy)
            trainer.save_states(str(folder / "t.states"))
            files[policy] = (folder / "t.states").read_bytes()
        return files[policy]

    return get


def _sealed(path: Path, arrays: Any) -> None:
    """An NDArray file of ``arrays`` with a good checksum line: what passes the checksum."""
    nd.save(str(path), arrays)
    body = path.read_bytes()
    path.write_bytes(body + seal(body))


def _header(raw: bytes) -> nd.NDArray:
    out = nd.empty((len(raw),), dtype=np.uint8)
    out[:] = np.frombuffer(raw, dtype=np.uint8)
    return out


def _refused(path: Path, message: str, policy: str = "O2-bf16") -> None:
    """Loading ``path`` into a fresh Trainer raises ``message`` and changes nothing."""
    net, fresh = _trained(1, policy)
    before = _snapshot(net, fresh)
    with pytest.raises(CheckpointError, match=message):
        fresh.load_states(str(path))
    assert _snapshot(net, fresh) == before


# ---------------------------------------------------------------------- the file as a whole


def test_a_flipped_byte_fails_the_checksum(tmp_path: Path, saved: Callable[[str], bytes]) -> None:
    raw = bytearray(saved("O2-bf16"))
    raw[len(raw) // 2] ^= 0x01
    path = tmp_path / "t.states"
    path.write_bytes(bytes(raw))
    _refused(path, "its SHA-256 checksum does not match its contents")


@pytest.mark.parametrize("arrays", ["list", "no-header"])
def test_an_ndarray_file_without_the_header_is_refused(tmp_path: Path, arrays: str) -> None:
    path = tmp_path / "t.states"
    ones = nd.ones((2,))
    _sealed(path, [ones] if arrays == "list" else {"optimizer/0/0": ones})
    _refused(path, r"\(no mixprec header\)")


def test_a_sealed_pickle_is_not_read_as_a_pickle(tmp_path: Path) -> None:
    """The checksum line says format /3: what it seals is read as an NDArray file, never
    unpickled, however short (a pickle of an empty dict is five bytes)."""
    body = pickle.dumps({})
    path = tmp_path / "t.states"
    path.write_bytes(body + seal(body))
    _refused(path, "is not a readable trainer states file")


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (b"\xff\xfe", r"\(header: 'utf-8' codec can't decode"),
        (b"{not json", r"\(header: Expecting property name"),
        (b"[1, 2]", r"\(format None, expected 'mixprec-mxnet-states/3'\)"),
        (b'{"format": "mixprec-mxnet-states/9"}', r"\(format 'mixprec-mxnet-states/9', "),
    ],
    ids=["not-utf8", "not-json", "not-a-dict", "another-format"],
)
def test_a_header_that_is_not_this_format_is_refused(
    tmp_path: Path, header: bytes, message: str
) -> None:
    path = tmp_path / "t.states"
    _sealed(path, {META: _header(header)})
    _refused(path, message)


# ---------------------------------------------------------------------- the optimizer state


def _first_param(spec: Any) -> Edit:
    def edit(meta: dict[str, Any], arrays: dict[str, Any]) -> None:
        meta["per_param"]["0"] = spec

    return edit


def _no_per_param(meta: dict[str, Any], arrays: dict[str, Any]) -> None:
    del meta["per_param"]


def _per_param_list(meta: dict[str, Any], arrays: dict[str, Any]) -> None:
    meta["per_param"] = list(meta["per_param"].values())


def _keyed_by_name(meta: dict[str, Any], arrays: dict[str, Any]) -> None:
    meta["per_param"]["first"] = meta["per_param"].pop("0")


def _nested(levels: int) -> Any:
    spec: Any = None
    for _ in range(levels):
        spec = {"tuple": [spec]}
    return spec


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_no_per_param, r"\(no optimizer state\)"),
        (_per_param_list, r"\(no optimizer state\)"),
        (_keyed_by_name, r"\(optimizer state keyed 'first'\)"),
        (_first_param({"array": "optimizer/9/9"}), r"state \{'array': 'optimizer/9/9'\}\)"),
        (_first_param({"array": 7}), r"\(optimizer state \{'array': 7\}\)"),
        (_first_param({"tuple": 5}), r"\(optimizer state \{'tuple': 5\}\)"),
        (_first_param({"list": "ab"}), r"\(optimizer state \{'list': 'ab'\}\)"),
        (_first_param({"set": []}), r"\(optimizer state \{'set': \[\]\}\)"),
        (_first_param({"tuple": [], "list": []}), r"\(optimizer state \{'tuple': \[\], "),
        (_first_param(5), r"\(optimizer state 5\)"),
        (_first_param("x"), r"\(optimizer state x\)"),
        (_first_param(_nested(9)), r"\(optimizer state nested too deeply\)"),
    ],
    ids=[
        "no-per-param",
        "per-param-list",
        "keyed-by-name",
        "array-not-in-file",
        "array-not-a-name",
        "tuple-not-a-list",
        "list-not-a-list",
        "unknown-kind",
        "two-kinds",
        "a-number",
        "a-string",
        "nested-too-deeply",
    ],
)
def test_an_optimizer_state_that_describes_no_array_is_refused(
    tmp_path: Path, saved: Callable[[str], bytes], edit: Edit, message: str
) -> None:
    path = tmp_path / "t.states"
    path.write_bytes(saved("O2-bf16"))
    rewrite_states(path, edit)
    _refused(path, message)


def test_an_inf_in_the_compensation_is_refused(
    tmp_path: Path, saved: Callable[[str], bytes]
) -> None:
    def inf_compensation(meta: dict[str, Any], arrays: dict[str, Any]) -> None:
        key = sorted(k for k in arrays if k.startswith("compensation/"))[0]
        bad = arrays[key].asnumpy()
        bad.flat[0] = np.inf
        arrays[key] = nd.array(bad, dtype=bad.dtype)

    path = tmp_path / "t.states"
    path.write_bytes(saved("O3-bf16-kahan"))
    rewrite_states(path, inf_compensation)
    _refused(path, r"inf or NaN in the compensation of '0\.", "O3-bf16-kahan")


# ---------------------------------------------------------------------- quantized state


LOWBIT = "O2-bf16,state=int8(block=32,min_size=0)"  # the small net's arrays quantized too


def _lowbit(**change: Any) -> Edit:
    """An edit of the first quantized state array's description: ``change`` replaces its
    items (``None`` deletes one); ``whole`` replaces the description."""

    def edit(meta: dict[str, Any], arrays: dict[str, Any]) -> None:
        states = [s for s in meta["per_param"].values() if "lowbit" in json.dumps(s)]
        first = states[0]["tuple"][0]
        if "whole" in change:
            first["lowbit"] = change["whole"]
            return
        for key, value in change.items():
            if value is None:
                del first["lowbit"][key]
            else:
                first["lowbit"][key] = value

    return edit


@pytest.mark.parametrize(
    "edit",
    [
        _lowbit(whole=["int8/256"]),
        _lowbit(format=None),
        _lowbit(extra=1),
        _lowbit(format=8),
        _lowbit(signed="yes"),
        _lowbit(shape="16"),
        _lowbit(shape=[1] * 9),
        _lowbit(shape=[-1, 8]),
        _lowbit(shape=[2.0, 8]),
        _lowbit(shape=[True, 8]),
        _lowbit(codes="optimizer/9/9/codes"),
        _lowbit(absmax=3),
    ],
    ids=[
        "not-a-dict",
        "no-format",
        "another-key",
        "format-not-text",
        "signed-not-bool",
        "shape-not-a-list",
        "shape-too-long",
        "shape-negative",
        "shape-float",
        "shape-bool",
        "codes-not-in-file",
        "absmax-not-a-name",
    ],
)
def test_a_quantized_state_that_describes_no_codes_is_refused(
    tmp_path: Path, saved: Callable[[str], bytes], edit: Edit
) -> None:
    path = tmp_path / "t.states"
    path.write_bytes(saved(LOWBIT))
    rewrite_states(path, edit)
    _refused(path, r"\(quantized optimizer state ", LOWBIT)


# ---------------------------------------------------------------------- decode_state's limits


ARRAYS = {"a": nd.ones((2,)), "c": nd.zeros((4,), dtype=np.uint8), "m": nd.ones((1,))}


def test_state_nested_to_the_limit_is_read_and_one_level_more_is_not() -> None:
    spec: Any = {"array": "a"}
    for _ in range(8):
        spec = {"tuple": [spec]}
    state = decode_state(spec, ARRAYS, "f")
    for _ in range(8):
        assert isinstance(state, tuple) and len(state) == 1
        state = state[0]
    assert state is ARRAYS["a"]
    with pytest.raises(CheckpointError, match="nested too deeply"):
        decode_state({"list": [spec]}, ARRAYS, "f")


def test_the_kinds_of_state_keep_their_kind() -> None:
    assert decode_state(None, ARRAYS, "f") is None
    pair = decode_state({"tuple": [{"array": "a"}, None]}, ARRAYS, "f")
    assert type(pair) is tuple and pair == (ARRAYS["a"], None)
    items = decode_state({"list": [{"array": "a"}]}, ARRAYS, "f")
    assert type(items) is list and items[0] is ARRAYS["a"]


@pytest.mark.parametrize("shape", [[1] * 8, [0, 4], []], ids=["eight-dims", "empty-dim", "scalar"])
def test_a_quantized_state_at_the_limits_of_its_shape_is_read(shape: list[int]) -> None:
    spec = {"format": "int8/256", "signed": True, "shape": shape, "codes": "c", "absmax": "m"}
    state = decode_state({"lowbit": spec}, ARRAYS, "f")
    assert isinstance(state, LowBitArray)
    assert (state.shape, state.signed, state.tag) == (tuple(shape), True, "int8/256")
    assert state.codes is ARRAYS["c"] and state.absmax is ARRAYS["m"]


# ---------------------------------------------------------------------- sizes, indices, codes


def _limit(tmp_path: Path, trainer: Trainer) -> int:
    """The most bytes ``trainer`` reads from a states file, as its refusal states it."""
    huge = tmp_path / "huge.states"
    with open(huge, "wb") as f:
        f.truncate(1 << 30)  # sparse: no disk used
    with pytest.raises(CheckpointError, match=r"more than the states") as caught:
        trainer.load_states(str(huge))
    found = re.search(r"can take \((\d+)\)", str(caught.value))
    assert found is not None
    return int(found.group(1))


def test_a_file_of_the_largest_size_is_read_and_one_byte_more_is_not(tmp_path: Path) -> None:
    net, trainer = _trained(1)
    limit = _limit(tmp_path, trainer)
    assert limit > 16 << 20  # the header's room and the states of the net's elements
    before = _snapshot(net, trainer)
    path = tmp_path / "t.states"
    for size, message in [(limit, "not a readable trainer states file"), (limit + 1, "more than")]:
        with open(path, "wb") as f:
            f.truncate(size)
        with pytest.raises(CheckpointError, match=message):
            trainer.load_states(str(path))
    assert _snapshot(net, trainer) == before


def test_a_file_that_grows_while_it_is_read_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its size when it was opened (``fstat``) said less than what the read found."""
    net, trainer = _trained(1)
    path = tmp_path / "t.states"
    with open(path, "wb") as f:
        f.truncate(_limit(tmp_path, trainer) + 1)
    real = os.fstat

    def fstat_before_it_grew(fd: int) -> os.stat_result:
        info = list(real(fd))
        info[stat.ST_SIZE] = 0
        return os.stat_result(info)

    before = _snapshot(net, trainer)
    monkeypatch.setattr(os, "fstat", fstat_before_it_grew)
    with pytest.raises(CheckpointError, match="changed while it was read"):
        trainer.load_states(str(path))
    monkeypatch.undo()
    assert _snapshot(net, trainer) == before


@pytest.mark.parametrize("index", ["-1", "4"])
def test_state_of_a_parameter_the_trainer_does_not_have_is_refused(
    tmp_path: Path, saved: Callable[[str], bytes], index: str
) -> None:
    def renumbered(meta: dict[str, Any], arrays: dict[str, Any]) -> None:
        meta["per_param"][index] = meta["per_param"].pop("3")  # the net has 4 parameters

    path = tmp_path / "t.states"
    path.write_bytes(saved("O2-bf16"))
    rewrite_states(path, renumbered)
    _refused(path, rf"optimizer state for parameter indices \[{index}\], but this Trainer has 4")


def test_state_of_another_shape_is_refused_with_both_shapes(
    tmp_path: Path, saved: Callable[[str], bytes]
) -> None:
    def reshaped(meta: dict[str, Any], arrays: dict[str, Any]) -> None:
        arrays[meta["per_param"]["1"]["tuple"][0]["array"]] = nd.zeros((3, 3))

    path = tmp_path / "t.states"
    path.write_bytes(saved("O2-bf16"))
    rewrite_states(path, reshaped)
    _refused(path, r"optimizer state of shape \(3, 3\) for parameter '.*' of shape \(16, 8\)")


def test_codes_of_another_format_are_refused(tmp_path: Path, saved: Callable[[str], bytes]) -> None:
    path = tmp_path / "t.states"
    path.write_bytes(saved(LOWBIT))
    rewrite_states(path, _lowbit(format="int4/32"))
    _refused(path, r"quantized as 'int4/32', but this Trainer keeps its optimizer state as", LOWBIT)


def test_codes_load_into_a_trainer_without_low_bit_state_as_float32(
    tmp_path: Path, saved: Callable[[str], bytes]
) -> None:
    path = tmp_path / "t.states"
    path.write_bytes(saved(LOWBIT))
    _, trainer = _trained(1)
    trainer.load_states(str(path))
    for index, state in trainer._updaters[0].states.items():
        for array in state:
            assert isinstance(array, nd.NDArray) and array.dtype == np.float32
            assert array.shape == trainer._params[index].shape
