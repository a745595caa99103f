"""BatchNorm islands in a hybridized bfloat16 net: where oneDNN can fuse the casts."""

from __future__ import annotations

import json

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

from _mx_nets import batch, cnn  # noqa: E402

import mixprec.mxnet as mpx  # noqa: E402

pytestmark = pytest.mark.mxnet


def _batchnorm_inputs(net: object) -> list[str]:
    """The op feeding each BatchNorm in the hybridized graph, in order."""
    graph = json.loads(net._cached_graph[1].tojson(remove_amp_cast=False))  # type: ignore[attr-defined]
    nodes = graph["nodes"]
    return [nodes[n["inputs"][0][0]]["op"] for n in nodes if n["op"] == "BatchNorm"]


def test_batchnorm_after_a_blocked_conv_reads_bf16_and_keeps_fp32_statistics() -> None:
    net = cnn()
    mpx.Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
    net.hybridize()
    x, _ = batch(image=True)
    net(x)
    # the first conv reads 1 channel (plain NCHW output): the island keeps its casts; the
    # second reads 16 (oneDNN's blocked layout): BatchNorm takes bf16 data directly
    assert _batchnorm_inputs(net) == ["amp_cast", "Convolution"]
    bn = net[4]
    assert {p.dtype for p in bn.collect_params().values()} == {np.float32}


def test_fused_island_matches_the_cast_island() -> None:
    x, _ = batch(image=True)
    outputs = []
    for hybrid in (False, True):  # imperative nets always cast around the island
        net = cnn(seed=3)
        mpx.Trainer(net, "sgd", {"learning_rate": 0.1}, policy="O2-bf16")
        if hybrid:
            net.hybridize()
        with mx.autograd.record():
            outputs.append(net(x).asnumpy())
    imperative, hybridized = outputs
    assert hybridized.dtype == np.float32
    np.testing.assert_allclose(hybridized, imperative, rtol=0.05, atol=0.05)
