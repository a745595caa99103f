"""Low-bit optimizer state for optax: the codec is the NumPy reference's, bit for bit; the
state transform keeps Adam's, AdamW's, AMSGrad's and SGD's moments as codes between steps;
``Optimizer`` applies it for ``state=int8|int4|fp8`` under every master strategy."""

from __future__ import annotations

import functools
import io
import runpy
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tests._models import batch, loss_fn, params

import mixprec.jax as mpj
from mixprec.errors import CheckpointError, MixprecError, WrapError
from mixprec.kit import LOWBIT_FORMATS, StateFormat, parse_state_format, state_map
from mixprec_jax import lowbit

reference = pytest.importorskip("mixprec_numpy.lowbit")
TINY = np.finfo(np.float32).tiny


def _fmt(text: str) -> StateFormat:
    fmt = parse_state_format(text)
    assert fmt is not None
    return fmt


def _flushed(x: np.ndarray) -> np.ndarray:
    return np.where(np.abs(x) >= TINY, x, np.float32(0.0)).astype(np.float32)


def _bits(x: Any) -> bytes:
    return np.asarray(x, np.float32).view(np.uint32).tobytes()


@functools.cache
def _codec(fmt: StateFormat, signed: bool) -> Any:
    def run(x: jax.Array) -> tuple[lowbit.QuantizedArray, jax.Array]:
        q = lowbit.quantize(x, fmt, signed)
        return q, lowbit.dequantize(q, fmt, signed, x.shape)

    return jax.jit(run)


def _data(fmt: StateFormat, signed: bool) -> np.ndarray:
    rng = np.random.default_rng(7)
    x = rng.standard_normal(701) * 10.0 ** rng.integers(-36, 37, 701)  # 1/a underflows too
    x[:5] = [3.4e38, -3e38, 0.0, -0.0, 1e-40]
    mids = np.array(state_map(fmt.name, signed).mids)
    ties = [[1.0, *mids[i : i + fmt.block - 1]] for i in range(0, mids.size, fmt.block - 1)]
    ties = [t + [0.0] * (fmt.block - len(t)) for t in ties]  # each chunk in a block of its own
    return np.concatenate([np.ravel(ties), np.ravel(ties) * 3.0, x]).astype(np.float32)


@pytest.mark.parametrize("name", LOWBIT_FORMATS)
@pytest.mark.parametrize("signed", [True, False])
def test_the_codec_is_the_numpy_reference_with_subnormals_flushed(name: str, signed: bool) -> None:
    """Under jit, ties on the midpoints and divisors whose reciprocal underflows included:
    XLA would turn ``x / a`` into ``x * (1 / a)`` if the codec let it."""
    fmt = _fmt(f"{name}(block=64)")
    x = _data(fmt, signed)
    q, decoded = _codec(fmt, signed)(jnp.asarray(x))
    want = reference.quantize(_flushed(x), fmt, signed)
    assert np.asarray(q.codes).tobytes() == want.codes.tobytes()
    assert _bits(q.absmax) == _bits(want.absmax)
    wanted = _flushed(reference.dequantize(want, fmt, signed, x.size))
    assert _bits(decoded) == _bits(wanted)


# ---------------------------------------------------------------------- the transform

PARAMS = {"big": jnp.linspace(-1.0, 1.0, 300, dtype=jnp.float32), "small": jnp.ones(3)}


def _grads(seed: int) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(rng.standard_normal(v.shape), jnp.float32) for k, v in PARAMS.items()}


@pytest.mark.parametrize(
    ("make", "fields"),
    [
        (lambda: optax.adamw(1e-2), {"mu": True, "nu": False}),
        (lambda: optax.amsgrad(1e-2), {"mu": True, "nu": False, "nu_max": False}),
        (lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True), {"trace": True}),
    ],
    ids=["adamw", "amsgrad", "sgd-momentum"],
)
def test_the_moments_are_the_references_codes_of_optaxs_own_moments(
    make: Any, fields: dict[str, bool]
) -> None:
    fmt = _fmt("int4(block=32,min_size=10)")
    plain, tx = make(), mpj.quantized_state(make(), fmt)
    state = tx.init(PARAMS)
    update = jax.jit(tx.update)
    for seed in range(3):
        holder = next(s for s in state if hasattr(s, next(iter(fields))))
        # the float32 state the codes stand for, then optax's own update of it
        decoded = holder._replace(
            **{
                f: {
                    "big": lowbit.dequantize(getattr(holder, f)["big"], fmt, s, (300,)),
                    "small": getattr(holder, f)["small"],
                }
                for f, s in fields.items()
            }
        )
        plain_state = tuple(decoded if s is holder else s for s in state)
        want_updates, want_state = jax.jit(plain.update)(_grads(seed), plain_state, PARAMS)
        updates, state = update(_grads(seed), state, PARAMS)
        np.testing.assert_array_equal(updates["big"], want_updates["big"])
        holder = next(s for s in state if hasattr(s, next(iter(fields))))
        want_holder = next(s for s in want_state if hasattr(s, next(iter(fields))))
        for f, signed in fields.items():
            moment = getattr(holder, f)
            assert isinstance(moment["big"], mpj.QuantizedArray)  # 300 elements: codes
            assert moment["small"].dtype == jnp.float32  # under min_size: float32
            want = reference.quantize(
                _flushed(np.asarray(getattr(want_holder, f)["big"])), fmt, signed
            )
            assert np.asarray(moment["big"].codes).tobytes() == want.codes.tobytes()


def test_keep_and_min_size_keep_float32_state() -> None:
    tx = mpj.quantized_state(optax.adam(1e-3), "int8(min_size=0,keep=sm*)")
    mu = tx.init(PARAMS)[0].mu
    assert isinstance(mu["big"], mpj.QuantizedArray) and mu["big"].codes.dtype == jnp.uint8
    assert not isinstance(mu["small"], mpj.QuantizedArray)


@pytest.mark.parametrize(
    "make", [lambda: optax.adafactor(1e-3), lambda: optax.rmsprop(1e-3), lambda: optax.lion(1e-3)]
)
def test_an_optimizer_with_other_state_is_refused_naming_the_supported_ones(make: Any) -> None:
    tx = mpj.quantized_state(make(), "int8(min_size=0)")
    with pytest.raises(WrapError, match=r"optax\.adamw"):
        tx.init(PARAMS)


def test_a_bfloat16_moment_and_a_bad_format_are_refused() -> None:
    with pytest.raises(WrapError, match="mu_dtype"):
        mpj.quantized_state(optax.adam(1e-3, mu_dtype=jnp.bfloat16), "int8(min_size=0)").init(
            PARAMS
        )
    with pytest.raises(WrapError, match="low-bit format"):
        mpj.quantized_state(optax.adam(1e-3), "bfloat16")


def test_sgd_without_momentum_has_nothing_to_quantize() -> None:
    state = mpj.quantized_state(optax.sgd(0.1), "int8(min_size=0)").init(PARAMS)
    leaves = jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, mpj.QuantizedArray))
    assert not any(isinstance(x, mpj.QuantizedArray) for x in leaves)


# ---------------------------------------------------------------------- the Optimizer


def _run(opt: mpj.Optimizer, steps: int, blow_up_at: int = -1) -> tuple[Any, list[float]]:
    step = opt.make_step(loss_fn)
    state, losses = opt.init(params()), []
    x, y = batch()
    for i in range(steps):
        loss, state, _ = step(state, (x, y, jnp.int32(i == blow_up_at)))  # int: never cast
        losses.append(float(loss))
    return state, losses


def _codes(state: Any) -> list[bytes]:
    leaves = jax.tree_util.tree_leaves(state.opt_state)
    return [np.asarray(x).tobytes() for x in leaves]


def test_optimizer_trains_skips_and_resumes_with_quantized_state() -> None:
    policy = "O2,state=int8(block=32,min_size=0)"
    opt = mpj.Optimizer(optax.adamw(1e-2), policy=policy)
    state, losses = _run(opt, 6)
    mu = state.opt_state[0].mu["params"]["Dense_0"]["kernel"]
    assert isinstance(mu, mpj.QuantizedArray) and mu.codes.dtype == jnp.uint8
    assert losses[-1] < losses[0]
    step = opt.make_step(loss_fn)
    x, y = batch()
    _, skipped, info = step(state, (x, y, jnp.int32(1)))  # the loss overflows
    assert bool(info.skipped) and _codes(skipped) == _codes(state)
    buffer = io.BytesIO()
    opt.save(buffer, state)
    buffer.seek(0)
    loaded = opt.load(buffer, like=opt.init(params(1)))
    assert _codes(loaded) == _codes(state)
    a = step(state, (x, y, jnp.int32(0)))
    b = step(loaded, (x, y, jnp.int32(0)))
    assert float(a[0]) == float(b[0]) and _codes(a[1]) == _codes(b[1])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["O0", "O1", "O2-bf16", "O3-bf16-kahan", "O3-bf16-sr"])
@pytest.mark.parametrize("name", LOWBIT_FORMATS)
def test_every_strategy_trains_close_to_float32_state(strategy: str, name: str) -> None:
    quantized = mpj.Optimizer(optax.adamw(1e-2), policy=f"{strategy},state={name}(min_size=0)")
    plain = mpj.Optimizer(optax.adamw(1e-2), policy=strategy)
    _, losses = _run(quantized, 40, blow_up_at=3)
    _, reference_losses = _run(plain, 40, blow_up_at=3)
    assert losses[-1] < 0.7 * losses[0]  # it learns
    # issue 35's targets against the float32 state: int8 3 %, fp8 6 %; int4 ends 1.12x here
    # (a 40-step run of a tiny MLP whose every tensor is quantized; 0.94x on the digits CNN
    # and 1.01x on the teacher-student MLP of benchmarks/lowbit_state.py): bounded at 1.15
    assert losses[-1] < {"int8": 1.03, "int4": 1.15, "fp8": 1.06}[name] * reference_losses[-1]


def test_a_non_finite_moment_skips_the_step() -> None:
    # finite gradients scaled past float32 before the momentum: the guard sees nothing
    tx = optax.chain(optax.scale(1e30), optax.scale(1e30), optax.trace(0.9), optax.scale(0.0))
    opt = mpj.Optimizer(tx, policy="O0,state=int8(min_size=0)")
    state, _ = _run(opt, 1)
    assert int(state.skipped_steps) == 1 and int(state.steps) == 1
    np.testing.assert_array_equal(
        state.weights["params"]["head"]["kernel"], params()["params"]["head"]["kernel"]
    )


def test_a_checkpoint_with_codes_beyond_the_map_is_refused() -> None:
    opt = mpj.Optimizer(optax.sgd(0.1, momentum=0.9), policy="O0,state=int4(min_size=0)")
    state = opt.init(params())
    trace = state.opt_state[0].trace
    kernel = trace["params"]["head"]["kernel"]
    broken = jax.tree_util.tree_map(lambda x: x, trace)
    broken["params"]["head"]["kernel"] = kernel._replace(codes=jnp.full_like(kernel.codes, 0xFF))
    bad = state._replace(
        opt_state=(state.opt_state[0]._replace(trace=broken), *state.opt_state[1:])
    )
    buffer = io.BytesIO()
    opt.save(buffer, bad)
    buffer.seek(0)
    with pytest.raises(CheckpointError, match="beyond the 15 values"):
        opt.load(buffer, like=state)


def test_bfloat16_state_is_still_refused_and_low_bit_accepted() -> None:
    with pytest.raises(MixprecError, match="state=int8"):
        mpj.Optimizer(optax.adam(1e-3), policy="O3-bf16-kahan,state=bfloat16")
    opt = mpj.Optimizer(optax.adam(1e-3), policy="O3-bf16-sr,state=fp8")
    assert opt.state_format == _fmt("fp8")


def test_the_pages_example_keeps_adamws_moments_in_int8(capsys: pytest.CaptureFixture[str]) -> None:
    ns = runpy.run_path(str(Path(__file__).parents[1] / "examples" / "lowbit_state.py"))
    assert capsys.readouterr().out.splitlines() == ["uint8 (131072,) (512,)", "float32"]
    state = ns["state"]
    held = sum(x.nbytes for x in jax.tree_util.tree_leaves(state.opt_state[0][1:]))
    params = sum(x.size for x in jax.tree_util.tree_leaves(state.weights))
    assert held / params < 2.1  # issue 35: int8 at most 2.1 bytes of state a parameter
