"""O1 for Gluon: cast ops inside the hybridized graph, per the policy's op and module rules.

MXNet's own AMP (``mxnet.contrib.amp.convert_hybrid_block``) rewrites a traced symbol with
the C++ ``ReducePrecision`` pass: it inserts ``amp_cast`` before ops in the low-precision
list, ``amp_cast`` to float32 before ops in the float32 list, and ``amp_multicast`` before
ops that run in their widest input type. That function returns a new ``SymbolBlock`` with
copied parameters and hard-codes the widest list, so mixprec calls the same pass through
``MXReducePrecisionSymbol`` with lists built from the policy (:func:`mixprec_mxnet.ops.amp_lists`)
and installs the result as the net's own cached graph: users keep calling the same ``net``,
its parameters stay the trained ones, and nothing global (``mx.nd``, ``mx.sym``) is patched.

Module rules act per node: nodes inside a module pinned to float32 (``*BatchNorm*`` by
default) are excluded from low precision, which the pass runs in float32. A node belongs to
the block whose name prefix is the longest prefix of the node's name.

**Float32 islands keep the policy's numerics.** Where this CPU has no bfloat16 kernel for an
op the policy computes in bfloat16 (``FullyConnected``, ``Convolution``... on CPUs without
AVX512: :func:`mixprec_mxnet.ops.island_natives`), the pass must run it in float32; on its own
that made O1-bf16 on such a CPU train bit for bit like float32 while the
``Bf16IslandWarning`` said the outputs were "cast back to bfloat16" (issue 37).
:func:`round_islands` therefore rounds each such node's inputs and outputs to bfloat16
(as ``amp_cast`` to bfloat16 and back to float32 would, with float32 arithmetic that is ~30x
faster on such a CPU: :func:`bf16_rounding_nodes`), which is what the bfloat16 kernel reads
and writes: the island computes on the values a bfloat16 op sees, accumulates in float32 as
oneDNN's bfloat16 GEMM does, and its result carries bfloat16's rounding, forward and
backward (the casts' backward rounds the gradients that flow through). So O1-bf16 on an AVX2
CPU trains like O1-bf16 on an AVX512-BF16 CPU up to the order of float32 accumulation, and
like the NumPy reference's emulation of the same policy.
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import mxnet as mx
from mxnet import gluon
from mxnet.ndarray import NDArray
from mxnet.symbol import Symbol

from mixprec.errors import MixprecWarning, WrapError
from mixprec.kit import FLOAT32, Policy, is_floating, is_low_precision, module_rule

from ..bf16_rounding import symbol_round_bf16
from ..blocks import BlockInfo, blocks_of
from ..dtypes import dtype_name, mx_dtype, mx_type_code
from ..gluon_private import (
    compose,
    dtype_from_type_code,
    infer_type_codes,
    install_traced_graph,
    reduce_precision_symbol,
)
from ..ops import AmpLists, amp_lists, family_of, island_natives, native_name

__all__ = [
    "convert_symbol",
    "install_graph_pass",
    "island_nodes",
    "node_dtypes",
    "protect_accumulation",
    "round_islands",
]


def _owner(name: str, blocks: Sequence[BlockInfo]) -> BlockInfo | None:
    best = None
    for info in blocks:
        if info.prefix and name.startswith(info.prefix):
            if best is None or len(info.prefix) > len(best.prefix):
                best = info
    return best


def _excluded_nodes(sym: Symbol, policy: Policy, blocks: Sequence[BlockInfo]) -> list[str]:
    """Names of the nodes module rules keep in float32; refuse the rules the pass cannot do.

    Also asks ``policy.decide`` once per op node, which raises for banned ops.
    """
    excluded = []
    for node in json.loads(sym.tojson())["nodes"]:
        if node["op"] == "null":
            continue
        family = family_of(node["op"], node.get("attrs", {}))
        op = family or native_name(node["op"])
        owner = _owner(node["name"], blocks)
        path, classes = (owner.path, owner.classes) if owner else (None, None)
        decision = policy.decide(op, (policy.compute,), module=path, module_class=classes)
        if decision.source in ("global", "default"):
            continue
        if decision.source == "module-op":
            lst = _module_list(policy, op, path, classes)
            if lst == "fp32":
                excluded.append(node["name"])
                continue
            if lst == policy.ops.list_of(op):
                continue
        elif decision.dtype == FLOAT32:
            excluded.append(node["name"])
            continue
        raise WrapError(
            f"the {decision.rule} runs {node['op']} in block {path!r} in {decision.dtype}; "
            "MXNet's graph pass can only keep modules, or ops inside them, in float32. Pin "
            "the module to float32, or move the op in the global lists (policy.with_ops)"
        )
    return excluded


def island_nodes(
    sym: Symbol, policy: Policy, device: str, blocks: Sequence[BlockInfo] = ()
) -> list[str]:
    """Names of the nodes the policy computes in its low-precision dtype whose op has no
    kernel for it on this machine (each runs as a float32 island)."""
    missing = island_natives(policy.compute, device)
    if not missing or not is_low_precision(policy.compute):
        return []
    found = []
    for node in json.loads(sym.tojson(remove_amp_cast=False))["nodes"]:
        if node["op"] not in missing:
            continue
        family = family_of(node["op"], node.get("attrs", {}))
        owner = _owner(node["name"], blocks)
        path, classes = (owner.path, owner.classes) if owner else (None, None)
        decision = policy.decide(
            family or native_name(node["op"]), (policy.compute,), module=path, module_class=classes
        )
        if decision.dtype == policy.compute:
            found.append(node["name"])
    return found


def round_islands(
    sym: Symbol, names: Sequence[str], dtype: str, *, amp_casts: bool = False
) -> Symbol:
    """``sym`` with the inputs and outputs of the nodes ``names`` rounded to ``dtype``, forward
    and backward: :func:`bf16_rounding_nodes` for bfloat16, else (or with ``amp_casts``)
    ``amp_cast`` to ``dtype`` and back to float32 (see the module docstring)."""
    if not names:
        return sym
    wanted = set(names)
    graph = json.loads(sym.tojson(remove_amp_cast=False))
    target = dtype_name(mx_dtype(dtype))
    nodes: list[dict[str, Any]] = []
    moved: dict[int, int] = {}  # old node index -> new
    rounded_out: dict[tuple[int, int], list[int]] = {}  # an island's output -> its rounding

    def entry(old: list[int]) -> list[int]:
        return rounded_out.get((old[0], old[1]), [moved[old[0]], old[1], old[2]])

    def rounding(source: list[int], name: str) -> list[int]:
        if target == BFLOAT16_NAME and not amp_casts:
            return bf16_rounding_nodes(nodes, source)
        nodes.append(
            {
                "op": "amp_cast",
                "name": f"{name}_low",
                "attrs": {"dtype": target},
                "inputs": [source],
            }
        )
        low = [len(nodes) - 1, 0, 0]
        nodes.append({"op": "amp_cast", "name": name, "attrs": {"dtype": FLOAT32}, "inputs": [low]})
        return [len(nodes) - 1, 0, 0]

    # an island's rounded output read by one island only needs no second rounding: forward
    # and backward, rounding twice is rounding once
    readers = Counter((e[0], e[1]) for n in graph["nodes"] for e in n["inputs"])
    readers.update((h[0], h[1]) for h in graph["heads"])

    def rounded_input(old: list[int], name: str) -> list[int]:
        key = (old[0], old[1])
        if key in rounded_out and readers[key] == 1:
            return rounded_out[key]
        return rounding(entry(old), name)

    for index, node in enumerate(graph["nodes"]):
        inputs = [entry(e) for e in node["inputs"]]
        island = node["op"] != "null" and node["name"] in wanted
        if island:
            inputs = [
                rounded_input(e, f"{node['name']}_mixprec_round_in{i}")
                for i, e in enumerate(node["inputs"])
            ]
        nodes.append(dict(node, inputs=inputs))
        moved[index] = len(nodes) - 1
        if island:
            rounded_out[(index, 0)] = rounding(
                [moved[index], 0, 0], f"{node['name']}_mixprec_round_out"
            )
    graph["nodes"] = nodes
    graph["arg_nodes"] = [i for i, n in enumerate(nodes) if n["op"] == "null"]
    graph["heads"] = [entry(h) for h in graph["heads"]]
    graph.pop("node_row_ptr", None)
    return mx.sym.load_json(json.dumps(graph))


BFLOAT16_NAME = "bfloat16"
_SPLICED = "mixprec_rounded_value"


def bf16_rounding_nodes(nodes: list[dict[str, Any]], source: list[int]) -> list[int]:
    """Append to ``nodes`` (a symbol's JSON graph) the nodes of
    :func:`~mixprec_mxnet.bf16_rounding.symbol_round_bf16` reading ``source``: ``source``
    rounded to bfloat16 in float32 arithmetic, forward and backward, as an ``amp_cast`` pair
    would at ~1/16 of its cost on an AVX2 CPU. Returns the result's entry."""
    template = json.loads(symbol_round_bf16(mx.sym.var(_SPLICED)).tojson())
    moved: dict[int, int] = {}  # template node -> its index in nodes

    def entry(e: list[int]) -> list[int]:
        return source if e[0] not in moved else [moved[e[0]], e[1], e[2]]

    for index, node in enumerate(template["nodes"]):
        if node["op"] != "null":  # the one variable is source
            nodes.append(dict(node, inputs=[entry(e) for e in node["inputs"]]))
            moved[index] = len(nodes) - 1
    return entry(template["heads"][0])


def _module_list(policy: Policy, op: str, path: str | None, classes: Any) -> str | None:
    found = module_rule(policy.modules, path, classes, lambda rule: rule.op_list(op))
    return None if found is None else found[1]


def reduce_precision(
    sym: Symbol, lists: AmpLists, excluded: Sequence[str], data_names: Sequence[str]
) -> Symbol:
    """Run MXNet's ReducePrecision pass with the given lists (what ``amp.convert_symbol``
    does, minus its check that restricts every list to MXNet's built-in op sets)."""
    params = sorted(set(sym.list_inputs()) - set(data_names))
    return reduce_precision_symbol(
        sym,
        mx_type_code(lists.target_dtype),
        (lists.lowp, lists.fp32, lists.widest),
        lists.conditional_list(),
        excluded,
        params,
        data_names,
    )


def convert_symbol(
    sym: Symbol,
    inputs: Sequence[Symbol],
    input_dtypes: Sequence[str],
    policy: Policy,
    device: str,
    blocks: Sequence[BlockInfo] = (),
    *,
    amp_casts: bool = False,
) -> Symbol:
    """``sym`` with the casts ``policy`` asks for (O1), for inputs of ``input_dtypes``.

    The pass assumes graph inputs are float32 and never casts a variable feeding a float32
    op, so inputs of another floating dtype get an ``identity`` node the casts can attach to.
    Outputs come out in ``policy.output``. With ``amp_casts`` the islands are rounded by
    ``amp_cast`` pairs, which MXNet's ``remove_amp_cast`` (Gluon's own ``export``) drops:
    for contrib.amp's conversions, whose converted nets export as float32 models.
    """
    lists = amp_lists(policy, device)
    excluded = _excluded_nodes(sym, policy, blocks)
    names = [s.name for s in inputs]
    wrapped = {
        name: mx.sym.identity(mx.sym.var(name), name=f"{name}_mixprec_input")
        for name, dtype in zip(names, input_dtypes, strict=True)
        if dtype != FLOAT32 and is_floating(dtype)
    }
    if wrapped:
        sym = compose(sym, **wrapped)
    islands = [n for n in island_nodes(sym, policy, device, blocks) if n not in set(excluded)]
    converted = reduce_precision(sym, lists, excluded, names)
    converted = round_islands(converted, islands, policy.compute, amp_casts=amp_casts)
    _warn_unhonoured(converted, lists)
    if policy.output != FLOAT32:
        outs = [
            mx.sym.amp_cast(converted[i], dtype=mx_dtype(policy.output))
            for i in range(len(converted.list_outputs()))
        ]
        converted = mx.sym.Group(outs) if len(outs) > 1 else outs[0]
    return converted


def _warn_unhonoured(sym: Symbol, lists: AmpLists) -> None:
    ops = {node["op"] for node in json.loads(sym.tojson())["nodes"]}
    hit = sorted(op for op in lists.unhonoured if op in ops)
    if hit:
        rules = "; ".join(f"{op} ({lists.unhonoured[op]})" for op in hit)
        warnings.warn(
            f"these ops run in float32 although the policy's rule says otherwise, because "
            f"MXNet {mx.__version__} has no {lists.target_dtype} kernel for them here: {rules}. "
            "Move their families to fp32 (policy.with_ops(fp32=[...])) to silence this",
            MixprecWarning,
            stacklevel=4,
        )


def node_dtypes(sym: Symbol, **input_dtypes: str) -> dict[str, str]:
    """The canonical output dtype of every node of ``sym`` whose type can be inferred from
    the given input dtypes (canonical names: bfloat16 is passed by MXNet's type code, which
    ``Symbol.infer_type`` cannot do)."""
    internals = sym.get_internals()
    codes = infer_type_codes(internals, {k: mx_type_code(v) for k, v in input_dtypes.items()})
    out = {}
    for name, code in zip(internals.list_outputs(), codes, strict=True):
        if code >= 0:
            key = name[: -len("_output")] if name.endswith("_output") else name
            out[key] = dtype_name(dtype_from_type_code(code))
    return out


def install_graph_pass(
    net: gluon.HybridBlock,
    policy: Policy,
    device: str,
    blocks: Sequence[BlockInfo] | None = None,
    *,
    amp_casts: bool = False,
) -> None:
    """Make ``net`` run its hybridized graph converted per ``policy`` (in place).

    The conversion happens when the graph is traced (the first call, or after a
    ``hybridize()`` that clears the cache), for the dtypes of the inputs of that call and the
    ``grad_req`` the parameters have then (set ``grad_req='add'`` before the first forward, or
    call ``net.hybridize()`` again after changing it).

    :param blocks: ``net``'s blocks as :func:`~mixprec_mxnet.blocks.blocks_of` lists them,
        where the caller has walked the net already (the Trainer's construction plan).
    :param amp_casts: see :func:`convert_symbol`.
    """
    blocks = list(blocks_of(net)) if blocks is None else list(blocks)

    def convert(trace: Callable[[], tuple[Any, Symbol]], args: Sequence[Any]) -> Any:
        try:
            inputs, out = trace()
        except Exception as exc:
            raise WrapError(
                f"O1 casts ops in the hybridized graph, but {type(net).__name__} could not "
                f"be traced symbolically ({type(exc).__name__}: {exc}). Make its "
                "hybrid_forward use only F.* ops (no asnumpy, no Python control flow on "
                "values), or use an O2 policy, which casts at block boundaries"
            ) from exc
        flat = [a for a in _flatten(args) if a is not None]
        dtypes = [dtype_name(a.dtype) if isinstance(a, NDArray) else FLOAT32 for a in flat]
        converted = convert_symbol(out, inputs, dtypes, policy, device, blocks, amp_casts=amp_casts)
        # amp_cast's backward drops grad_req='add': read accumulated parameters through identity
        added = [p.name for p in net.collect_params().values() if p.grad_req == "add"]
        return inputs, protect_accumulation(converted, added)

    install_traced_graph(net, convert)


def protect_accumulation(sym: Symbol, names: Sequence[str]) -> Symbol:
    """``sym`` with each input in ``names`` read through an ``identity`` node, so that
    ``grad_req='add'`` accumulates into it (``amp_cast``'s backward would overwrite nothing)."""
    present = set(sym.list_inputs())
    wrapped = {
        name: mx.sym.identity(mx.sym.var(name), name=f"{name}_mixprec_accumulate")
        for name in names
        if name in present
    }
    return compose(sym, **wrapped) if wrapped else sym


def _flatten(args: Any) -> list[Any]:
    if isinstance(args, (list, tuple)):
        return [leaf for arg in args for leaf in _flatten(arg)]
    return [args]
