"""Low-bit optimizer state on Gluon (issue 35): ``Trainer(..., policy="O2-bf16,state=int8")``.

What a user relies on: the optimizer's moments are codes between steps (about a quarter of
float32's bytes under int8, an eighth under int4), the update itself runs on float32 values
decoded from them, a skipped step leaves the codes alone, a states file resumes bit for bit
and refuses codes of another format, float32 files load into a low-bit Trainer and the other
way round, and the codec gives the torch backend's codes for the same values.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

from _mx_nets import batch, master_values, mlp, rewrite_states, states_header, train_step  # noqa: E402
from mxnet import gluon, nd  # noqa: E402

from mixprec.errors import CheckpointError, PolicyError, WrapError  # noqa: E402
from mixprec.kit import LOWBIT_FORMATS, parse_state_format, state_map  # noqa: E402
from mixprec_mxnet import Trainer  # noqa: E402
from mixprec_mxnet.lowbit import codec  # noqa: E402
from mixprec_mxnet.lowbit.state import LowBitArray, state_bytes  # noqa: E402
from mixprec_mxnet.step import multi_tensor, protocol  # noqa: E402

pytestmark = pytest.mark.mxnet

L2 = gluon.loss.L2Loss()
SMALL = "O2-bf16,state=int8(block=32,min_size=0)"
MOMENTUM = {"sgd": 0.9, "nag": 0.9}


def _trainer(
    policy: str = SMALL, optimizer: str = "adam", net: Any = None, **kwargs: Any
) -> tuple[Any, Trainer]:
    net = net if net is not None else mlp()
    params: dict[str, Any] = {"learning_rate": 0.01}
    if optimizer in MOMENTUM:
        params["momentum"] = MOMENTUM[optimizer]
    return net, Trainer(net, optimizer, params, policy=policy, **kwargs)


def _train(net: Any, trainer: Trainer, steps: int, inject_at: int | None = None) -> None:
    x, y = batch()
    for i in range(steps):
        train_step(net, trainer, x, y, L2, inject=i == inject_at)


def _arrays(state: Any) -> list[Any]:
    return list(state) if isinstance(state, (tuple, list)) else [state]


def _codes(trainer: Trainer, updater: int = 0) -> dict[tuple[int, int], tuple[bytes, bytes]]:
    """Every quantized state array's codes and absmax, as bytes."""
    out = {}
    for index, state in trainer._updaters[updater].states.items():
        for position, array in enumerate(_arrays(state)):
            assert isinstance(array, LowBitArray), f"state {index}.{position} is {array!r}"
            out[index, position] = (
                array.codes.asnumpy().tobytes(),
                array.absmax.asnumpy().tobytes(),
            )
    return out


def _masters(net: Any, trainer: Trainer) -> dict[str, bytes]:
    return {k: v.tobytes() for k, v in master_values(trainer, net).items()}


# ---------------------------------------------------------------------- the codec


def _values(signed: bool, n: int = 1000, seed: int = 0) -> np.ndarray:
    """Moment-like float32 values over many decades, an all-zero block, a short last block."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * np.exp(rng.uniform(-25, 3, n))
    x[32:64] = 0.0
    x = x.astype(np.float32)
    return x if signed else x * x


@pytest.fixture(scope="module")
def twin() -> Any:
    """The torch backend's codec (the backends never import each other; a test may)."""
    torch = pytest.importorskip("torch")
    from mixprec_torch.lowbit import codec

    return torch, codec


@pytest.mark.parametrize("name", LOWBIT_FORMATS)
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_the_codec_gives_the_torch_twins_codes(twin: Any, name: str, signed: bool) -> None:
    torch, twin = twin
    for spec in (name, f"{name}(block=32)"):
        fmt = parse_state_format(spec)
        assert fmt is not None
        x = _values(signed, n=1001)
        codes, absmax = codec.quantize(x, fmt, signed)
        want_codes, want_absmax = twin.quantize(torch.from_numpy(x), fmt, signed)
        assert np.array_equal(codes, want_codes.numpy())
        assert absmax.tobytes() == want_absmax.numpy().tobytes()
        decoded = codec.dequantize(codes, absmax, fmt, signed, x.size)
        want = twin.dequantize(want_codes, want_absmax, fmt, signed, x.size)
        assert decoded.tobytes() == want.numpy().tobytes()


@pytest.mark.parametrize("name", LOWBIT_FORMATS)
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_the_bucket_tables_count_the_mids_below_every_value(name: str, signed: bool) -> None:
    """The table lookup is ``#{mids < n}`` exactly: on the mids themselves (a tie takes the
    lower code), their float32 neighbours, the map's values, zeros and random values."""
    tables = codec.tables(name, signed)
    assert tables.exact, "a bucket holds two mids: the lookup would fall back to a search"
    mids, values = tables.mids, tables.values
    up, down = np.nextafter(mids, np.float32(2)), np.nextafter(mids, np.float32(-2))
    rng = np.random.default_rng(1)
    normal = np.concatenate(
        [mids, up, down, values, [0.0, -0.0, 1.0, -1.0], rng.uniform(-1, 1, 4096)]
    ).astype(np.float32)
    normal = normal[np.abs(normal) <= 1]
    assert np.array_equal(tables.codes(normal), np.searchsorted(mids, normal, side="left"))


@pytest.mark.parametrize("name", LOWBIT_FORMATS)
def test_codes_round_trip_and_the_largest_element_is_exact(name: str) -> None:
    fmt = parse_state_format(f"{name}(block=32)")
    assert fmt is not None
    for signed in (True, False):
        x = _values(signed, n=101)
        codes, absmax = codec.quantize(x, fmt, signed)
        assert codes.dtype == np.uint8 and codes.size == codec.code_count(fmt, x.size)
        assert absmax.size == codec.block_count(fmt, x.size) == 4
        decoded = codec.dequantize(codes, absmax, fmt, signed, x.size)
        again, _ = codec.quantize(decoded, fmt, signed)
        assert np.array_equal(codes, again), "decoded values encode to other codes"
        for b in range(4):  # each block's absmax is stored exactly
            block = x[32 * b : 32 * (b + 1)]
            if block.any():
                assert np.abs(decoded[32 * b : 32 * (b + 1)]).max() == np.abs(block).max()
        assert len(state_map(name, signed).values) <= 256


# ---------------------------------------------------------------------- between steps


@pytest.mark.parametrize("optimizer", ["sgd", "nag", "adam", "adamw", "lamb"])
def test_the_state_is_codes_between_steps_and_training_moves(optimizer: str) -> None:
    net, trainer = _trainer(optimizer=optimizer)
    x, y = batch()
    first = train_step(net, trainer, x, y, L2)
    for _ in range(3):
        last = train_step(net, trainer, x, y, L2)
    assert last < first
    layout = 1 if optimizer in MOMENTUM else 2
    for state in trainer._updaters[0].states.values():
        arrays = _arrays(state)
        assert len(arrays) == layout
        for position, array in enumerate(arrays):
            assert isinstance(array, LowBitArray)
            assert array.tag == "int8/32" and array.signed == (position == 0)
            assert array.codes.dtype == np.uint8


def _bytes_per_param(policy: str) -> float:
    net = gluon.nn.Dense(256, in_units=256, use_bias=False)
    net.initialize(mx.init.Xavier())
    trainer = Trainer(net, "adam", {"learning_rate": 1e-3}, policy=policy)
    x = nd.random.normal(shape=(4, 256))
    train_step(net, trainer, x, x, L2)
    return state_bytes(trainer._updaters[0].states) / net.weight.shape[0] / net.weight.shape[1]


def test_state_bytes_per_parameter() -> None:
    """Adam keeps two moments: 8 bytes a parameter in float32; int8 keeps one byte a moment
    and a float32 absmax per 256 elements, int4 half a byte and one per 128."""
    assert _bytes_per_param("O2-bf16") == 8.0
    assert _bytes_per_param("O2-bf16,state=int8") == pytest.approx(2 * (1 + 4 / 256))
    assert _bytes_per_param("O2-bf16,state=int4") == pytest.approx(2 * (0.5 + 4 / 128))
    assert _bytes_per_param("O2-bf16,state=fp8") == pytest.approx(2 * (1 + 4 / 256))


def test_min_size_and_keep_leave_float32_state() -> None:
    """Parameters under ``min_size`` elements, and those ``keep`` names, keep float32 moments."""
    net, trainer = _trainer("O2-bf16,state=int8(min_size=64,keep=1.*)")
    _train(net, trainer, 2)
    names = trainer._mixprec.lowbit.names  # type: ignore[union-attr]
    kinds = {
        names[i]: {type(a).__name__ for a in _arrays(s)}
        for i, s in trainer._updaters[0].states.items()
    }
    assert kinds == {
        "0.weight": {"LowBitArray"},  # 128 elements
        "0.bias": {"NDArray"},  # 16 < min_size
        "1.weight": {"NDArray"},  # kept
        "1.bias": {"NDArray"},
    }


def test_the_update_runs_on_decoded_float32_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside the step the optimizer sees float32 arrays of the parameter's shape, holding
    the values the codes stand for."""
    net, trainer = _trainer()
    _train(net, trainer, 2)
    before = {i: [a.numpy() for a in _arrays(s)] for i, s in trainer._updaters[0].states.items()}
    seen: dict[int, list[np.ndarray]] = {}
    real = multi_tensor.update

    def spy(updater: Any, indices: Any, grads: Any, weights: Any) -> None:
        for index in indices:
            arrays = _arrays(updater.states[index])
            assert all(type(a) is nd.NDArray and a.dtype == np.float32 for a in arrays)
            seen[index] = [a.asnumpy().copy() for a in arrays]
        real(updater, indices, grads, weights)

    monkeypatch.setattr(protocol.multi_tensor, "update", spy)
    _train(net, trainer, 1)
    assert sorted(seen) == sorted(before)
    for index, arrays in seen.items():
        for got, want in zip(arrays, before[index], strict=True):
            assert got.tobytes() == want.tobytes()


def test_a_skipped_step_leaves_codes_and_absmax_bit_identical() -> None:
    net, trainer = _trainer(loss_scale="dynamic")
    _train(net, trainer, 2)
    codes, masters = _codes(trainer), _masters(net, trainer)
    _train(net, trainer, 1, inject_at=0)
    assert trainer.last_step_skipped
    assert _codes(trainer) == codes
    assert _masters(net, trainer) == masters
    _train(net, trainer, 1)
    assert _codes(trainer) != codes


@pytest.mark.parametrize("path", ["multi-tensor", "per-parameter"])
def test_both_update_paths_quantize(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """SGD momentum runs MXNet's multi-tensor kernel or Gluon's updater: the same codes."""
    results = []
    for env in ("1", "0" if path == "per-parameter" else "1"):
        monkeypatch.setenv(multi_tensor.ENV, env)
        net, trainer = _trainer(optimizer="sgd")
        _train(net, trainer, 3)
        results.append((_codes(trainer), _masters(net, trainer)))
    assert results[0] == results[1]


def _overflow(net: Any, trainer: Trainer) -> None:
    """One step whose ``lr * grad`` overflows the momentum (finite gradients: no skip)."""
    trainer.set_learning_rate(3e38)
    x, y = batch()
    train_step(net, trainer, x * 1e3, y * 1e3, L2)


def test_a_non_finite_moment_is_refused_and_the_state_kept() -> None:
    """A learning rate that overflows the momentum: PolicyError names the parameter, and the
    codes stay those of the step before."""
    net, trainer = _trainer(optimizer="sgd")
    _train(net, trainer, 2)
    codes = _codes(trainer)
    with pytest.raises(PolicyError, match=r"inf or NaN.*keep="):
        _overflow(net, trainer)
    assert _codes(trainer) == codes


def test_a_non_finite_first_moment_drops_the_new_state() -> None:
    net, trainer = _trainer(optimizer="sgd")
    with pytest.raises(PolicyError):
        _overflow(net, trainer)
    assert trainer._updaters[0].states == {}


# ---------------------------------------------------------------------- refusals


@pytest.mark.parametrize("optimizer", ["rmsprop", "adagrad", "ftml"])
def test_an_unsupported_optimizer_is_refused_naming_the_supported_ones(optimizer: str) -> None:
    net = mlp()
    with pytest.raises(WrapError, match=r"'sgd', 'nag', 'adam', 'adamw', 'lamb'"):
        Trainer(net, optimizer, {"learning_rate": 0.01}, policy=SMALL)
    Trainer(net, optimizer, {"learning_rate": 0.01}, policy="O2-bf16")  # the net is as it was


def test_a_subclass_of_a_supported_optimizer_is_refused() -> None:
    class MyAdam(mx.optimizer.Adam):  # type: ignore[misc]
        pass

    with pytest.raises(WrapError, match="MyAdam"):
        Trainer(mlp(), MyAdam(learning_rate=0.01), policy=SMALL)


@pytest.mark.parametrize("policy", ["O0", "O1-bf16", "O3-bf16-kahan", "O3-bf16-sr"])
def test_every_float32_updating_strategy_takes_a_low_bit_state(policy: str) -> None:
    """float32 weights, float32 masters, and the compensated strategies' working masters."""
    net, trainer = _trainer(f"{policy},output=float32,state=int4(block=32,min_size=0)")
    _train(net, trainer, 2)
    assert _codes(trainer)


# ---------------------------------------------------------------------- states files


def _save(trainer: Trainer, net: Any, tmp_path: Path, name: str) -> tuple[Path, Path]:
    params, states = tmp_path / f"{name}.params", tmp_path / f"{name}.states"
    net.save_parameters(str(params))
    trainer.save_states(str(states))
    return params, states


def test_save_and_load_resume_bit_for_bit(tmp_path: Path) -> None:
    net, trainer = _trainer(loss_scale="dynamic")
    _train(net, trainer, 3)
    params, states = _save(trainer, net, tmp_path, "a")
    header = states_header(states)
    index = trainer._param2idx[net[0].weight.name]
    node = header["per_param"][str(index)]["tuple"][1]["lowbit"]
    assert node["format"] == "int8/32" and node["signed"] is False and node["shape"] == [16, 8]
    saved = nd.load(str(states))
    assert saved[node["codes"]].dtype == np.uint8
    net2, resumed = _trainer(net=mlp(seed=1), loss_scale="dynamic")
    net2.load_parameters(str(params))
    resumed.load_states(str(states))
    assert _codes(resumed) == _codes(trainer)
    for i in range(3):
        _train(net, trainer, 1, inject_at=0 if i == 1 else None)
        _train(net2, resumed, 1, inject_at=0 if i == 1 else None)
    assert _codes(resumed) == _codes(trainer)
    assert _masters(net2, resumed) == _masters(net, trainer)
    assert resumed.skipped_steps == trainer.skipped_steps == 1


def test_the_quantized_file_is_smaller(tmp_path: Path) -> None:
    sizes = {}
    for policy in ("O2-bf16", "O2-bf16,state=int8(min_size=0)"):
        net = gluon.nn.Dense(128, in_units=128)
        net.initialize()
        trainer = Trainer(net, "adam", {"learning_rate": 1e-3}, policy=policy)
        x = nd.random.normal(shape=(4, 128))
        train_step(net, trainer, x, x, L2)
        trainer.save_states(str(tmp_path / "s"))
        sizes[policy] = (tmp_path / "s").stat().st_size
    assert sizes["O2-bf16,state=int8(min_size=0)"] < 0.3 * sizes["O2-bf16"]


@pytest.mark.parametrize(
    "other", ["O2-bf16,state=int4(block=32,min_size=0)", "O2-bf16,state=int8(min_size=0)"]
)
def test_codes_of_another_format_or_block_size_are_refused(tmp_path: Path, other: str) -> None:
    net, trainer = _trainer()
    _train(net, trainer, 2)
    _, states = _save(trainer, net, tmp_path, "a")
    net2, target = _trainer(other)
    _train(net2, target, 1)
    before = _codes(target)
    with pytest.raises(CheckpointError, match=r"quantized as 'int8/32'.*nothing was loaded"):
        target.load_states(str(states))
    assert _codes(target) == before


def test_a_float32_states_file_loads_encoded(tmp_path: Path) -> None:
    net, plain = _trainer("O2-bf16")
    _train(net, plain, 2)
    params, states = _save(plain, net, tmp_path, "plain")
    floats = {i: [a.asnumpy() for a in s] for i, s in plain._updaters[0].states.items()}
    net2, trainer = _trainer(net=mlp(seed=1))
    net2.load_parameters(str(params))
    trainer.load_states(str(states))
    fmt = parse_state_format("int8(block=32)")
    assert fmt is not None
    for index, state in trainer._updaters[0].states.items():
        for position, array in enumerate(state):
            want, scale = codec.quantize(floats[index][position], fmt, position == 0)
            assert array.codes.asnumpy().tobytes() == want.tobytes()
            assert array.absmax.asnumpy().tobytes() == scale.tobytes()
    _train(net2, trainer, 1)  # and it trains on


def test_a_quantized_file_loads_decoded_into_a_float32_trainer(tmp_path: Path) -> None:
    """The way back: a Trainer without a low-bit state decodes the codes it loads."""
    net, trainer = _trainer()
    _train(net, trainer, 2)
    params, states = _save(trainer, net, tmp_path, "q")
    decoded = {i: [a.numpy() for a in s] for i, s in trainer._updaters[0].states.items()}
    net2, plain = _trainer("O2-bf16", net=mlp(seed=1))
    net2.load_parameters(str(params))
    plain.load_states(str(states))
    for index, state in plain._updaters[0].states.items():
        for got, want in zip(state, decoded[index], strict=True):
            assert isinstance(got, nd.NDArray) and got.dtype == np.float32
            assert got.asnumpy().tobytes() == want.tobytes()
    # one step from the same state: the float32 update is the update inside the low-bit step
    _train(net, trainer, 1)
    _train(net2, plain, 1)
    assert _masters(net2, plain) == _masters(net, trainer)
    fmt = parse_state_format("int8(block=32)")
    assert fmt is not None
    for index, state in plain._updaters[0].states.items():
        for position, array in enumerate(state):
            want, _ = codec.quantize(array.asnumpy(), fmt, position == 0)
            assert trainer._updaters[0].states[index][position].codes.asnumpy().tobytes() == (
                want.tobytes()
            )


def test_a_changed_min_size_decodes_on_load(tmp_path: Path) -> None:
    net, trainer = _trainer()
    _train(net, trainer, 2)
    _, states = _save(trainer, net, tmp_path, "q")
    _, bigger = _trainer("O2-bf16,state=int8(block=32,min_size=100)", net=mlp(seed=1))
    bigger.load_states(str(states))
    sizes = {
        i: (int(np.prod(bigger._params[i].shape)), {type(a).__name__ for a in s})
        for i, s in bigger._updaters[0].states.items()
    }
    assert all(
        kinds == ({"LowBitArray"} if n >= 100 else {"NDArray"}) for n, kinds in sizes.values()
    )


def _edit_node(states: Path, edit: Any) -> None:
    def change(header: dict[str, Any], arrays: dict[str, Any]) -> None:
        node = header["per_param"]["0"]["tuple"][0]["lowbit"]
        edit(node, arrays)

    rewrite_states(states, change)


def _set(arrays: dict[str, Any], key: str, values: np.ndarray) -> None:
    arrays[key] = nd.empty(values.shape, dtype=values.dtype)
    arrays[key][:] = values


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("nan", "inf, NaN or negative absmax"),
        ("negative", "inf, NaN or negative absmax"),
        ("code", "code beyond the format's map"),
        ("short", "does not fit its parameter"),
        ("map", "does not fit its parameter"),
        ("shape", "does not fit its parameter"),
        ("tag", "names no low-bit format"),
        ("node", "not a readable trainer states file"),
    ],
)
def test_damaged_codes_are_refused_before_anything_loads(
    tmp_path: Path, damage: str, message: str
) -> None:
    net, trainer = _trainer()
    _train(net, trainer, 2)
    _, states = _save(trainer, net, tmp_path, "q")

    def edit(node: dict[str, Any], arrays: dict[str, Any]) -> None:
        codes, absmax = arrays[node["codes"]].asnumpy(), arrays[node["absmax"]].asnumpy()
        if damage in ("nan", "negative"):
            absmax[0] = np.nan if damage == "nan" else -1.0
            _set(arrays, node["absmax"], absmax)
        elif damage == "code":
            codes[3] = 255  # the signed int8 map has 255 values: codes 0..254
            _set(arrays, node["codes"], codes)
        elif damage == "short":
            _set(arrays, node["codes"], codes[:-1])
        elif damage == "map":
            node["signed"] = False
        elif damage == "shape":
            node["shape"] = [8, 16]
        elif damage == "tag":
            node["format"] = "int9/32"
        else:
            node["codes"] = "optimizer/0/0/nowhere"

    _edit_node(states, edit)
    net2, target = _trainer(net=mlp(seed=1))
    _train(net2, target, 1)
    before = _codes(target)
    with pytest.raises(CheckpointError, match=message):
        target.load_states(str(states))
    assert _codes(target) == before


def test_a_flipped_byte_in_the_codes_fails_the_checksum(tmp_path: Path) -> None:
    net, trainer = _trainer()
    _train(net, trainer, 2)
    _, states = _save(trainer, net, tmp_path, "q")
    raw = bytearray(states.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    states.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="checksum"):
        trainer.load_states(str(states))


# ---------------------------------------------------------------------- contexts and workers


def test_every_context_keeps_the_same_codes() -> None:
    """Two CPU contexts: each updater keeps its replica's codes on its own context, and the
    replicas agree, as float32 replicas do."""
    ctx = [mx.cpu(0), mx.cpu(1)]
    net, trainer = _trainer(net=mlp(ctx=ctx))
    x, y = batch()
    for _ in range(3):
        with mx.autograd.record():
            losses = [
                L2(net(xs), ys)
                for xs, ys in zip(
                    gluon.utils.split_and_load(x, ctx),
                    gluon.utils.split_and_load(y, ctx),
                    strict=True,
                )
            ]
            with trainer.scale_loss(losses) as scaled:
                mx.autograd.backward(scaled)
        trainer.step(x.shape[0])
    assert _codes(trainer, 0) == _codes(trainer, 1)
    for updater, context in zip(trainer._updaters, ctx, strict=True):
        for state in updater.states.values():
            assert {a.context for a in state} == {context}


WORKER = Path(__file__).with_name("_mx_lowbit_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_dist_sync_workers_skip_together_and_keep_equal_codes(tmp_path: Path) -> None:
    """kvstore ``dist_sync`` (a scheduler, a server, two workers on 127.0.0.1): rank 1 puts an
    inf into a gradient at step 1; both skip it with their codes untouched, and both end with
    the same codes and masters."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PS_"))}
    env.update(
        DMLC_PS_ROOT_URI="127.0.0.1",
        DMLC_PS_ROOT_PORT=str(_free_port()),
        DMLC_NODE_HOST="127.0.0.1",
        DMLC_NUM_SERVER="1",
        DMLC_NUM_WORKER="2",
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="",
    )
    roles = [("scheduler", [sys.executable, "-c", "import mxnet"])]
    roles.append(("server", [sys.executable, "-c", "import mxnet"]))
    roles += [(f"worker{i}", [sys.executable, str(WORKER), str(tmp_path)]) for i in range(2)]
    procs = {}
    deadline = time.monotonic() + 60
    try:
        for name, argv in roles:
            role = "worker" if name.startswith("worker") else name
            with (tmp_path / f"{name}.log").open("wb") as log:
                procs[name] = subprocess.Popen(
                    argv, env=dict(env, DMLC_ROLE=role), stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )  # fmt: skip
        for name in ("worker0", "worker1", "server", "scheduler"):
            procs[name].wait(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    logs = {n: (tmp_path / f"{n}.log").read_text(errors="replace")[-2000:] for n in procs}
    assert all(procs[f"worker{i}"].returncode == 0 for i in range(2)), logs
    r0, r1 = sorted(
        (json.loads((tmp_path / f"worker{i}.json").read_text()) for i in range(2)),
        key=lambda r: r["rank"],
    )
    for r in (r0, r1):
        assert r["skipped"] == [False, True, False, False]
        assert r["codes"][1] == r["codes"][0], "the skipped step changed the codes"
        assert r["codes"][2] != r["codes"][1]
    assert r0["codes"] == r1["codes"]
    assert r0["masters"] == r1["masters"]


def test_deepcopy_copies_the_arrays() -> None:
    net, trainer = _trainer()
    _train(net, trainer, 1)
    array = _arrays(trainer._updaters[0].states[0])[0]
    twin = copy.deepcopy(array)
    assert twin.codes is not array.codes and twin.tag == array.tag
    assert twin.numpy().tobytes() == array.numpy().tobytes()


def test_the_guide_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Gluon example of the guide's low-bit section, as written there."""
    monkeypatch.chdir(tmp_path)
    guide = (Path(__file__).resolve().parents[2] / "docs" / "guide.md").read_text()
    block = guide.split("<!-- lowbit gluon example -->\n  ```python\n", 1)[1].split("  ```", 1)[0]
    code = "\n".join(line[2:] for line in block.splitlines())
    exec(compile(code, "guide.md", "exec"), {})
    # (the Dense(256, in_units=64) weight has 16384 elements: quantized; the rest stay float32)
    assert os.path.getsize("trainer.states") < 4 * 2 * 64 * 256
