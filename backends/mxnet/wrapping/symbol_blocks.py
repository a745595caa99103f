"""O2/O3 for ``SymbolBlock`` (an imported model): rules by operator, islands in its graph.

A ``SymbolBlock`` has no child blocks and no ``hybrid_forward`` calling ops through ``F``, so
the class-based rules (BatchNorm keeps float32 parameters) and the ``F``-based float32
islands of :mod:`mixprec_mxnet.wrapping.islands` cannot see inside it. Here both act on its graph:
:func:`fp32_params_by_op` finds the parameters BatchNorm nodes read (they stay float32, as
MXNet's kernel needs), and :func:`install_symbol_islands` rewrites the graph so that each op
without a kernel for the block's dtype on this machine reads float32 inputs (BatchNorm: its
data only) and its first output is cast back, as the islands of ordinary blocks do (an island
reading another island's output reads its float32 value, as chained islands do).

Imported graphs that already hold ``amp_cast``/``amp_multicast`` nodes (a net converted by
``mxnet.contrib.amp.convert_hybrid_block``, or mixprec's own bfloat16 export) are refused by
:func:`check_not_amp_converted`: their casts assume the dtypes they were made for and would
fight mixprec's. mixprec's default float32 export holds no cast and trains again.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import mxnet as mx
from mxnet import gluon
from mxnet.symbol import Symbol

from mixprec.errors import WrapError

from ..bf16_rounding import OUT_SUFFIX
from ..gluon_private import cached_graph, set_cached_graph
from .islands import DATA_ONLY_OPS

__all__ = [
    "GraphOp",
    "check_not_amp_converted",
    "fp32_params_by_op",
    "graph_ops",
    "has_amp_casts",
    "install_symbol_islands",
]

#: Ops whose parameter inputs MXNet requires in float32 (gamma, beta, running statistics).
FP32_PARAM_OPS = frozenset({"BatchNorm", "_contrib_BatchNormWithReLU", "_contrib_SyncBatchNorm"})
_AMP_OPS = frozenset({"amp_cast", "amp_multicast"})


@dataclass(frozen=True)
class GraphOp:
    """One operator node of a ``SymbolBlock``'s graph, for the dtype report."""

    name: str
    op: str
    params: tuple[str, ...]
    """The names of the graph's variables it reads directly (its weights, BatchNorm's
    gamma, beta and statistics); the block's data inputs are among them when read directly."""


def _nodes(sym: Symbol) -> list[dict[str, Any]]:
    return list(json.loads(sym.tojson())["nodes"])


def _symbol(block: gluon.Block) -> Symbol | None:
    if not isinstance(block, gluon.SymbolBlock):
        return None
    graph = cached_graph(block)
    return graph[1] if graph else None


def has_amp_casts(sym: Symbol) -> bool:
    """Whether ``sym`` holds ``amp_cast``/``amp_multicast`` nodes anywhere, or mixprec's own
    casts (:mod:`..bf16_rounding`).

    ``Symbol.tojson()`` cannot tell: by default it runs MXNet's ``RemoveAmpCast`` pass, which
    drops every cast that feeds another node, so only a cast that is an output would show.
    """
    graph = json.loads(sym.tojson(remove_amp_cast=False))
    return any(n["op"] in _AMP_OPS or n["name"].endswith(OUT_SUFFIX) for n in graph["nodes"])


def check_not_amp_converted(block: gluon.Block) -> None:
    """Refuse a ``SymbolBlock`` whose graph already holds low-precision casts."""
    sym = _symbol(block)
    if sym is not None and has_amp_casts(sym):
        raise WrapError(
            f"{type(block).__name__} {block.name!r} holds amp_cast/amp_multicast nodes: it was "
            "converted by mxnet.contrib.amp (convert_hybrid_block/convert_model) or exported "
            "with its casts (mixprec's net.export(path, dtype='bfloat16')). Give the Trainer "
            "the original float32 net, or its float32 export (net.export(path), the default), "
            "and choose the precision with policy= (O1-bf16 casts ops as MXNet AMP does)"
        )


def fp32_params_by_op(block: gluon.Block) -> set[str]:
    """Names of the parameters a ``SymbolBlock``'s BatchNorm-like nodes read."""
    sym = _symbol(block)
    if sym is None:
        return set()
    nodes = _nodes(sym)
    names = set()
    for node in nodes:
        if node["op"] in FP32_PARAM_OPS:
            for src, _, _ in node["inputs"][1:]:
                if nodes[src]["op"] == "null":
                    names.add(nodes[src]["name"])
    return names


def graph_ops(block: gluon.Block) -> list[GraphOp]:
    """The operator nodes of a ``SymbolBlock``'s graph in graph order (casts excluded: the
    islands' own ``amp_cast`` nodes are not ops of the model); empty for other blocks."""
    sym = _symbol(block)
    if sym is None:
        return []
    nodes = _nodes(sym)
    return [
        GraphOp(
            node["name"],
            node["op"],
            tuple(nodes[src]["name"] for src, _, _ in node["inputs"] if nodes[src]["op"] == "null"),
        )
        for node in nodes
        if node["op"] not in ("null", *_AMP_OPS)
    ]


def install_symbol_islands(block: gluon.Block, ops: Collection[str], dtype: str) -> None:
    """Rewrite a ``SymbolBlock``'s graph so the ``ops`` run as float32 islands."""
    sym = _symbol(block)
    if sym is None or not ops:
        return
    graph = json.loads(sym.tojson())
    if not any(n["op"] in ops for n in graph["nodes"]):
        return
    inputs = cached_graph(block)[0]
    set_cached_graph(block, (inputs, mx.sym.load_json(json.dumps(_islanded(graph, ops, dtype)))))


def _islanded(graph: dict[str, Any], ops: Collection[str], dtype: str) -> dict[str, Any]:
    new: list[dict[str, Any]] = []
    moved: dict[tuple[int, int], list[int]] = {}
    where: dict[int, int] = {}
    float32_of: dict[int, list[int]] = {}  # an island's cast back -> its float32 output

    def ref(entry: list[int]) -> list[int]:
        return moved.get((entry[0], entry[1]), [where[entry[0]], entry[1], 0])

    def cast(entry: list[int], name: str, to: str) -> list[int]:
        if to == "float32" and entry[0] in float32_of:  # chained islands: no round trip
            return float32_of[entry[0]]
        new.append({"op": "amp_cast", "name": name, "attrs": {"dtype": to}, "inputs": [entry]})
        return [len(new) - 1, 0, 0]

    for i, node in enumerate(graph["nodes"]):
        node = dict(node, inputs=[ref(e) for e in node["inputs"]])
        island = node["op"] in ops
        if island:
            count = 1 if node["op"] in DATA_ONLY_OPS else len(node["inputs"])
            for k in range(count):
                node["inputs"][k] = cast(node["inputs"][k], f"{node['name']}_fp32_in{k}", "float32")
        new.append(node)
        where[i] = len(new) - 1
        if island:
            moved[(i, 0)] = cast([where[i], 0, 0], f"{node['name']}_back", str(dtype))
            float32_of[moved[(i, 0)][0]] = [where[i], 0, 0]
    return {
        "nodes": new,
        "arg_nodes": [i for i, n in enumerate(new) if n["op"] == "null"],
        "heads": [ref(e) for e in graph["heads"]],
        "attrs": graph.get("attrs", {}),
    }
