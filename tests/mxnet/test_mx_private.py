"""The private MXNet/Gluon names the backend relies on still exist in the installed MXNet.

Each is listed, with the reason it is needed, in :mod:`mixprec_mxnet.gluon_private`. If an
MXNet upgrade renames one, these tests name it, instead of a training step failing later.
"""

from __future__ import annotations

import json

import pytest

mx = pytest.importorskip("mxnet")

from mxnet import gluon, nd  # noqa: E402

from mixprec_mxnet import gluon_private  # noqa: E402
from mixprec_mxnet.dtypes import BFLOAT16_NP  # noqa: E402
from mixprec_mxnet.o1.graph import node_dtypes  # noqa: E402

pytestmark = pytest.mark.mxnet


def _missing(obj: object, names: tuple[str, ...]) -> list[str]:
    return [name for name in names if not hasattr(obj, name)]


def test_block_parameter_ndarray_symbol_internals_exist() -> None:
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(2, in_units=3))
    net.initialize()
    param = net[0].weight
    missing = {
        "HybridBlock": _missing(net, gluon_private.BLOCK_STATE),
        "Parameter": _missing(param, gluon_private.PARAMETER_STATE),
        "NDArray": _missing(param.data(), gluon_private.NDARRAY_STATE),
        "Symbol": _missing(mx.sym.var("x"), gluon_private.SYMBOL_STATE),
    }
    assert not any(missing.values()), f"MXNet {mx.__version__} no longer has: {missing}"
    embedding = gluon.nn.Embedding(3, 2)
    assert not _missing(embedding, gluon_private.EMBEDDING_STATE)
    assert list(gluon_private.children(net)) == ["0"]
    assert gluon_private.own_params(net[0]) == [net[0].weight, net[0].bias]


def test_trainer_internals_exist() -> None:
    net = gluon.nn.Dense(2, in_units=3)
    net.initialize()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    missing = _missing(trainer, gluon_private.TRAINER_STATE + gluon_private.GLUON_TRAINER_ARGS)
    assert not missing, f"gluon.Trainer of MXNet {mx.__version__} no longer has: {missing}"
    missing = _missing(trainer._optimizer, gluon_private.OPTIMIZER_STATE)
    assert not missing, f"mx.optimizer.Optimizer of MXNet {mx.__version__} lacks: {missing}"


def test_the_two_c_api_calls_still_work() -> None:
    """MXReducePrecisionSymbol casts a FullyConnected's inputs; MXSymbolInferTypePartial
    infers bfloat16 through it (what O1 and the conformance adapter rely on)."""
    x = mx.sym.var("data")
    sym = mx.sym.FullyConnected(x, num_hidden=2, name="fc")
    code = gluon_private.type_code(BFLOAT16_NP)
    converted = gluon_private.reduce_precision_symbol(
        sym, code, (["FullyConnected"], [], []), [], [], ["fc_weight", "fc_bias"], ["data"]
    )
    ops = [node["op"] for node in json.loads(converted.tojson())["nodes"]]
    assert "amp_cast" in ops
    assert node_dtypes(converted, data="float32")["fc"] == "bfloat16"
    assert gluon_private.dtype_from_type_code(code) == BFLOAT16_NP
    assert node_dtypes(sym, data="bfloat16")["fc"] == "bfloat16"
    assert nd.ones((1,)).dtype == gluon_private.dtype_from_type_code(0)
