"""Low-bit optimizer state (state=int8|int4|fp8): the reference codec, the step around the
optimizer's update under every master strategy, skipped steps, checkpoints and refusals."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from mixprec.errors import CheckpointError, PolicyError, WrapError
from mixprec.kit import StateFormat, parse_state_format, state_map
from mixprec.testing.lowbit import reference_lowbit
from mixprec_numpy import MLP, SGD, Trainer
from mixprec_numpy.layers import Parameter
from mixprec_numpy.lowbit import LowBitState, dequantize, pack, quantize, unpack

X = np.random.default_rng(0).standard_normal((32, 6)).astype(np.float32)
Y = np.arange(32) % 3
SIZES = [6, 48, 3]  # weights of 288 and 144 elements, biases of 48 and 3
STRATEGIES = ("O0", "O1", "O2", "O2-bf16", "O3-bf16-kahan", "O3-bf16-sr")


def _fmt(text: str) -> StateFormat:
    fmt = parse_state_format(text)
    assert fmt is not None
    return fmt


# ---------------------------------------------------------------------- the codec


@pytest.mark.parametrize("name", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("signed", [True, False])
def test_map_values_times_a_power_of_two_decode_exactly(name: str, signed: bool) -> None:
    values = np.array(state_map(name, signed).values, np.float32)
    fmt = _fmt(f"{name}(block=4096)")
    x = values * np.float32(2.0**-9)  # exact: every value scaled, absmax 2**-9
    q = quantize(x, fmt, signed)
    codes = unpack(q.codes, x.size) if fmt.bits == 4 else q.codes
    assert codes.tolist() == list(range(values.size))
    assert q.absmax.tolist() == [2.0**-9]
    np.testing.assert_array_equal(dequantize(q, fmt, signed, x.shape), x)


def test_a_tie_on_a_midpoint_takes_the_lower_code_and_the_absmax_is_kept_exactly() -> None:
    fmt = _fmt("int4(block=32)")
    mids = state_map("int4", True).mids
    q = quantize(np.array([1.0, *mids], np.float32), fmt, True)  # x / a is each midpoint
    assert unpack(q.codes, len(mids) + 1).tolist()[1:] == list(range(len(mids)))
    x = np.array([0.1, -0.75, 0.2], np.float32)
    decoded = dequantize(quantize(x, fmt, True), fmt, True, x.shape)
    assert decoded[1] == np.float32(-0.75)  # the block's largest magnitude, stored exactly


def test_int4_codes_pack_two_per_byte_even_element_low() -> None:
    packed = pack(np.array([1, 2, 3, 4, 5], np.uint8))
    assert packed.tolist() == [0x21, 0x43, 0x05]
    assert unpack(packed, 5).tolist() == [1, 2, 3, 4, 5]


def test_blocks_zeros_and_short_last_block() -> None:
    fmt = _fmt("int8(block=32)")
    x = np.zeros(70, np.float32)
    x[64:] = [1e-3, -2e-3, 0.0, 5e-4, -0.0, 3e-3]
    q = quantize(x, fmt, True)
    assert q.codes.shape == (70,) and q.absmax.tolist() == [0.0, 0.0, np.float32(3e-3)]
    decoded = dequantize(q, fmt, True, (7, 10))
    assert decoded.shape == (7, 10) and not decoded.ravel()[:64].any()
    unsigned = quantize(np.zeros(5, np.float32), fmt, False)  # a zero-free map: code 0, a = 0
    assert dequantize(unsigned, fmt, False, 5).tolist() == [0.0] * 5


@pytest.mark.parametrize("state", ["int8", "int4(block=64)", "fp8(block=32)"])
@pytest.mark.parametrize("signed", [True, False])
def test_the_codec_is_the_pure_python_reference(state: str, signed: bool) -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(301) * 10.0 ** rng.integers(-9, 3, 301)).astype(np.float32)
    if not signed:
        x = np.square(x)
    codes, absmax, decoded = reference_lowbit(state, signed, x.tolist())
    fmt = _fmt(state)
    q = quantize(x, fmt, signed)
    assert q.codes.tolist() == codes and q.absmax.tolist() == absmax
    assert dequantize(q, fmt, signed, x.size).tolist() == decoded


# ---------------------------------------------------------------------- training


def _trainer(policy: str, seed: int = 0, momentum: float = 0.9) -> tuple[MLP, Trainer]:
    model = MLP(SIZES, seed=seed)
    return model, Trainer(model, SGD(lr=0.1, momentum=momentum), policy)


def _train(model: MLP, trainer: Trainer, steps: int, inf_at: tuple[int, ...] = ()) -> float:
    loss = 0.0
    for i in range(steps):
        loss = model.loss(X, Y)
        trainer.backward()
        if i in inf_at:
            grad = model.parameters()[0].grad
            assert grad is not None
            grad.flat[0] = np.inf
        trainer.step()
    return loss


def _codes(trainer: Trainer) -> dict[str, tuple[bytes, bytes]]:
    assert trainer.lowbit is not None
    return {k: (q.codes.tobytes(), q.absmax.tobytes()) for k, q in trainer.lowbit.codes.items()}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", ["int8", "int4", "fp8"])
def test_every_strategy_trains_with_the_moments_kept_as_codes(strategy: str, name: str) -> None:
    model, trainer = _trainer(f"{strategy},state={name}(min_size=64)")
    reference_model, reference = _trainer(strategy)
    loss = _train(model, trainer, 30)
    reference_loss = _train(reference_model, reference, 30)
    assert trainer.lowbit is not None
    quantized = {"layers.0.weight", "layers.2.weight"}  # the biases are under min_size
    assert set(trainer.lowbit.codes) == quantized
    assert set(trainer.optimizer.state) == {"layers.0.bias", "layers.2.bias"}  # float32
    for q in trainer.lowbit.codes.values():
        assert q.codes.dtype == np.uint8 and q.absmax.dtype == np.float32
    assert trainer.lowbit.codes["layers.0.weight"].codes.size == (144 if name == "int4" else 288)
    first = MLP(SIZES, seed=0).loss(X, Y)  # before training, in float32
    assert loss < 0.5 * first  # it learns
    if name != "int4":  # issue 35's targets against the float32 state: int8 3 %, fp8 6 %
        assert loss < {"int8": 1.03, "fp8": 1.06}[name] * reference_loss
    # int4's signed map has 15 values: SGD's momentum in it trains, but slower (here ~1.4x
    # the float32 state's loss after 30 steps; the 10 % target is AdamW's)


def test_one_step_is_decode_update_encode() -> None:
    fmt = _fmt("int8(block=32,min_size=0)")
    param = Parameter("w", np.linspace(-1, 1, 50, dtype=np.float32))
    sgd = SGD(lr=0.5, momentum=0.9)
    state = LowBitState(fmt, sgd, [param])
    rng = np.random.default_rng(2)
    for _ in range(3):
        grad = rng.standard_normal(50).astype(np.float32)
        before = param.data.copy()
        velocity = state.decode("w") if "w" in state.codes else None
        param.grad = grad
        state.update([param])
        step = grad if velocity is None else np.float32(0.9) * velocity + grad
        np.testing.assert_array_equal(param.data, before - np.float32(0.5) * step)
        assert state.codes["w"].codes.tobytes() == quantize(step, fmt, True).codes.tobytes()
        assert "w" not in sgd.state  # between steps only the codes


def test_a_moment_the_optimizer_does_not_touch_keeps_its_codes() -> None:
    fmt = _fmt("int4(block=32,min_size=0)")
    a = Parameter("a", np.ones(40, np.float32))
    b = Parameter("b", np.ones(40, np.float32))
    state = LowBitState(fmt, SGD(lr=0.1, momentum=0.9), [a, b])
    rng = np.random.default_rng(3)
    a.grad, b.grad = (rng.standard_normal(40).astype(np.float32) * 1e-3 for _ in range(2))
    state.update([a, b])
    kept = state.codes["b"].codes.tobytes(), state.codes["b"].absmax.tobytes()
    a.grad, b.grad = rng.standard_normal(40).astype(np.float32), None
    state.update([a, b])
    assert (state.codes["b"].codes.tobytes(), state.codes["b"].absmax.tobytes()) == kept


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_skipped_step_leaves_the_codes_bit_for_bit(strategy: str) -> None:
    model, trainer = _trainer(f"{strategy},state=int4(block=32,min_size=0)")
    _train(model, trainer, 3)
    before = _codes(trainer)
    _train(model, trainer, 1, inf_at=(0,))
    assert trainer.skipped_steps == 1
    assert _codes(trainer) == before
    _train(model, trainer, 1)
    assert _codes(trainer) != before


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", ["int8", "int4", "fp8"])
def test_save_and_resume_are_exact(strategy: str, name: str) -> None:
    policy = f"{strategy},state={name}(block=64,min_size=0)"
    model, trainer = _trainer(policy)
    _train(model, trainer, 4, inf_at=(2,))
    buffer = io.BytesIO()
    trainer.save(buffer)
    with np.load(io.BytesIO(buffer.getvalue())) as saved:
        assert saved["lowbit/layers.0.weight/codes"].dtype == np.uint8  # the quantized form
        assert not any(n.startswith("optimizer/") for n in saved.files)
    resumed_model, resumed = _trainer(policy, seed=5)
    buffer.seek(0)
    resumed.load(buffer)
    assert _codes(resumed) == _codes(trainer)
    losses = [_train(model, trainer, 3), _train(resumed_model, resumed, 3)]
    assert losses[0] == losses[1]
    assert _codes(resumed) == _codes(trainer)
    for (_, m), (_, r) in zip(trainer.masters.pairs, resumed.masters.pairs, strict=True):
        np.testing.assert_array_equal(m.data, r.data)


# ---------------------------------------------------------------------- refusals


def test_an_optimizer_without_declared_moments_is_refused() -> None:
    class Plain:
        def __init__(self) -> None:
            self.state: dict[str, object] = {}

        def update(self, params: list[Parameter]) -> None: ...

    with pytest.raises(WrapError, match=r"mixprec_numpy\.SGD"):
        Trainer(MLP(SIZES), Plain(), "O0,state=int8")  # type: ignore[arg-type]


def test_sgd_without_momentum_has_nothing_to_quantize() -> None:
    model, trainer = _trainer("O2,state=int8(min_size=0)", momentum=0.0)
    _train(model, trainer, 2)
    assert trainer.lowbit is not None and trainer.lowbit.codes == {}


def test_a_non_finite_moment_is_refused_and_the_step_undone() -> None:
    fmt = _fmt("int8(block=32,min_size=0)")
    param = Parameter("w", np.ones(40, np.float32))
    state = LowBitState(fmt, SGD(lr=0.1, momentum=0.9), [param])
    param.grad = np.full(40, 1e-3, np.float32)
    state.update([param])
    param.grad = np.full(40, 3e38, np.float32)  # 0.9 * v + g stays finite...
    state.update([param])
    param.grad = np.full(40, 3.4e38, np.float32)  # ...this one does not
    data, codes = param.data.copy(), state.codes["w"]
    with np.errstate(over="ignore"), pytest.raises(PolicyError, match="inf or NaN"):
        state.update([param])
    np.testing.assert_array_equal(param.data, data)
    assert state.codes["w"] is codes and "w" not in state.state


def _edited(trainer: Trainer, edit: str) -> io.BytesIO:
    buffer = io.BytesIO()
    trainer.save(buffer)
    buffer.seek(0)
    with np.load(buffer, allow_pickle=False) as saved:
        arrays = {name: saved[name] for name in saved.files}
    codes = "lowbit/layers.0.weight/codes"
    if edit == "short codes":
        arrays[codes] = arrays[codes][:-1]
    elif edit == "code beyond the map":
        arrays[codes] = np.full_like(arrays[codes], 255)
    elif edit == "nan absmax":
        arrays["lowbit/layers.2.weight/absmax"][0] = np.nan
    elif edit == "no absmax":
        del arrays["lowbit/layers.2.weight/absmax"]
    elif edit == "float32 moment":
        arrays["optimizer/layers.0.weight"] = np.zeros((6, 48), np.float32)
    elif edit == "another format":
        meta = json.loads(str(arrays["meta"]))
        meta["policy"]["state"] = "int4"
        arrays["meta"] = np.array(json.dumps(meta))
    out = io.BytesIO()
    np.savez(out, **arrays)
    out.seek(0)
    return out


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("short codes", "does not fit its parameter"),
        ("code beyond the map", "beyond the 255 values"),
        ("nan absmax", "inf, NaN or negative absmax"),
        ("no absmax", "lacks its codes or absmax"),
        ("float32 moment", "keeps it quantized"),
        ("another format", "different policy"),
    ],
)
def test_a_damaged_low_bit_checkpoint_is_refused_and_changes_nothing(
    edit: str, message: str
) -> None:
    model, trainer = _trainer("O2,state=int8(block=64,min_size=0)")
    _train(model, trainer, 2)
    checkpoint = _edited(trainer, edit)
    _train(model, trainer, 1)
    before = _codes(trainer), [m.data.copy() for _, m in trainer.masters.pairs]
    with pytest.raises(CheckpointError, match=message):
        trainer.load(checkpoint)
    assert _codes(trainer) == before[0]
    for (_, m), data in zip(trainer.masters.pairs, before[1], strict=True):
        np.testing.assert_array_equal(m.data, data)
