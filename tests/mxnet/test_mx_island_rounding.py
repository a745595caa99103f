"""The float32 islands' bfloat16 rounding, computed with float32 ops (issue 37, item 8).

O1's graph pass rounds the inputs and outputs of every float32 island to bfloat16, forward
and backward (:func:`mixprec_mxnet.o1.graph.round_islands`). ``amp_cast`` to bfloat16 and
back did that at ~120 ns per element and direction on an AVX2 CPU (O1-bf16 on model_zoo's
resnet18_v1 ran ~20x float32's step); the rounding now uses Veltkamp's splitting in float32
(:func:`~mixprec_mxnet.bf16_rounding.symbol_round_bf16`). These tests hold it to ``amp_cast``'s
bits: the graph with the new nodes against the same graph with explicit ``amp_cast`` pairs,
outputs and every gradient. They do not depend on the CPU: ``round_islands`` is given the
island nodes by name.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

from mxnet import nd  # noqa: E402

from mixprec_mxnet.dtypes import BFLOAT16_NP  # noqa: E402
from mixprec_mxnet.o1.graph import round_islands  # noqa: E402

pytestmark = pytest.mark.mxnet


def _rne(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest-even), as float32: the reference."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
    up = bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))
    return (up & np.uint32(0xFFFF0000)).view(np.float32)


def _wide(rng: np.random.Generator, shape: tuple[int, ...], binades: int = 60) -> np.ndarray:
    """Normal float32 values over 2 x ``binades`` binades, both signs, with exact ties and
    zeros."""
    x = rng.normal(size=shape) * np.exp2(rng.integers(-binades, binades, size=shape))
    x = x.astype(np.float32).ravel()
    bits = x.view(np.uint32)
    bits[::7] = (bits[::7] & np.uint32(0xFFFF0000)) | np.uint32(0x8000)  # halfway: ties
    bits[3::11] = (bits[3::11] & np.uint32(0xFFFF0000)) | np.uint32(0x7FFF)  # just below
    x[5::101] = 0.0
    x[6::101] = -0.0
    return x.reshape(shape)


def _pair(value: mx.sym.Symbol) -> mx.sym.Symbol:
    return mx.sym.amp_cast(mx.sym.amp_cast(value, dtype=BFLOAT16_NP), dtype="float32")


def _run(sym: mx.sym.Symbol, args: dict[str, np.ndarray], head: np.ndarray) -> list[np.ndarray]:
    """The outputs and the gradient of every argument, after one backward of ``head``."""
    arrays = {k: nd.array(v) for k, v in args.items()}
    grads = {k: nd.zeros(v.shape) for k, v in args.items()}
    ex = sym.bind(mx.cpu(), arrays, args_grad=grads)
    ex.forward(is_train=True)
    ex.backward(nd.array(head))
    return [ex.outputs[0].asnumpy()] + [grads[k].asnumpy() for k in sorted(args)]


def _same_bits(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    """Bit for bit, but for the sign of a zero gradient (a step by -0 is a step by 0)."""
    for g, w in zip(got, want, strict=True):
        zeros = (g == 0) & (w == 0)
        np.testing.assert_array_equal(g.view(np.uint32)[~zeros], w.view(np.uint32)[~zeros])


def test_an_island_rounds_forward_and_backward_to_amp_casts_bits() -> None:
    """One island: its input and output rounded, the gradient rounded on the way back."""
    rng = np.random.default_rng(0)
    x = mx.sym.var("x")
    island = mx.sym.relu(x, name="island")
    x_np, head = _wide(rng, (64, 257)), _wide(rng, (64, 257))
    got = _run(round_islands(island, ["island"], "bfloat16"), {"x": x_np}, head)
    want = _run(_pair(mx.sym.relu(_pair(x))), {"x": x_np}, head)
    _same_bits(got, want)
    np.testing.assert_array_equal(got[0].view(np.uint32), _rne(np.maximum(x_np, 0)).view(np.uint32))
    np.testing.assert_array_equal(got[1], _rne(head) * (_rne(x_np) > 0))


def test_chained_islands_a_residual_and_shared_inputs_keep_amp_casts_bits() -> None:
    """A net with every case of the pass: an island read by one island (rounded once), by
    an island and a residual ``+`` (rounded per reader: fc2's input gradient is not on the
    bfloat16 grid), a variable read by an island and another op, and weights: outputs and
    every gradient as with an ``amp_cast`` pair per edge."""
    rng = np.random.default_rng(1)
    x, w1, w2 = (mx.sym.var(n) for n in ("x", "w1", "w2"))

    def net(r: object) -> mx.sym.Symbol:
        rd = (lambda s: s) if r is None else r
        h = rd(mx.sym.FullyConnected(rd(x), rd(w1), no_bias=True, num_hidden=48, name="fc1"))
        a = rd(mx.sym.FullyConnected(rd(h), rd(w2), no_bias=True, num_hidden=48, name="fc2"))
        b = rd(mx.sym.relu(rd(a), name="act"))  # a: read by act alone, rounded once
        s = rd(mx.sym.sigmoid(rd(x * 0.5), name="sig"))  # x: read by fc1 and by * 0.5
        return mx.sym.broadcast_add(b + h, mx.sym.sum(s, axis=1, keepdims=True))  # h: fc2, +

    # products of the values stay under 2^112, where the rounding is amp_cast's
    args = {"x": _wide(rng, (16, 48), 20), "w1": _wide(rng, (48, 48), 20)}
    args["w2"] = _wide(rng, (48, 48), 20)
    head = _wide(rng, (16, 48), 20)
    islands = ["fc1", "fc2", "act", "sig"]
    got = _run(round_islands(net(None), islands, "bfloat16"), args, head)
    want = _run(net(_pair), args, head)
    _same_bits(got, want)


def test_the_pass_adds_no_amp_cast_for_bfloat16() -> None:
    x = mx.sym.var("x")
    sym = round_islands(mx.sym.relu(mx.sym.relu(x, name="a"), name="b"), ["a", "b"], "bfloat16")
    ops = [n["op"] for n in json.loads(sym.tojson())["nodes"]]
    assert "amp_cast" not in ops
    assert ops.count("_copy") == 3  # a's input, a's output (b reads it: no second), b's output


def test_where_the_rounding_differs_from_amp_cast_it_says_so() -> None:
    """The documented edges: subnormals keep a few more bits (under 2^-134 apart), an
    infinity and |x| >= 2^112 come out NaN, forward and backward: non-finite either way."""
    x = mx.sym.var("x")
    sym = round_islands(mx.sym.relu(x, name="r"), ["r"], "bfloat16")
    tiny = np.array([1e-45, 3e-41, 1.1e-38, 2.0**-127 * 1.2345], np.float32)
    out, grad = _run(sym, {"x": tiny}, tiny)
    assert np.all(np.abs(out - _rne(tiny)) <= 2.0**-133)
    assert np.all(np.abs(grad - _rne(tiny)) <= 2.0**-133)
    big = np.array([np.inf, 2.0**112, 3e38, 1.0], np.float32)
    out, grad = _run(sym, {"x": big}, big)
    assert np.isnan(out[:3]).all() and np.isnan(grad[:3]).all()
    assert out[3] == 1.0 and grad[3] == 1.0
