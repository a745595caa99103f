"""Convert a Gluon net in place for a policy: which dtype each parameter takes, and where
activations are cast.

- **O1-style policies** (op rules that cast) keep float32 parameters and cast inside the
  hybridized graph (:mod:`mixprec_mxnet.o1.graph`). A net that is not a ``HybridBlock`` gets the
  graph pass on each of its largest ``HybridBlock`` parts; ops written in a plain
  ``Block.forward`` run uncast.
- **O2/O3-style policies** (every op passes through) cast the parameters to ``param``, the
  net's floating inputs to ``param`` as well (MXNet ops need inputs and weights of one type;
  the presets have ``param == compute``) and its outputs to ``output``, and make every module a
  module rule pins to another dtype an *island*: its parameters take the pinned dtype, its
  inputs are cast to it on entry and its outputs back on exit (``BatchNorm`` stays float32
  this way, in training and in inference mode).

Two MXNet facts shape this: its CPU ``BatchNorm`` needs float32 ``gamma``/``beta``/running
statistics whatever the data dtype, and some layers have no bfloat16 CPU kernel
(:data:`ISLAND_BLOCKS`), so under bfloat16 on CPU those become float32 islands even when no
rule asks for it. Single ops without a kernel for a block's dtype on this machine
(``FullyConnected``, ``Convolution``... on a CPU without AVX512-BF16) become float32 islands
op by op, with the block's weights left in its dtype (:mod:`mixprec_mxnet.wrapping.islands`).

Every cast of a floating array goes through :func:`mixprec_mxnet.dtypes.cast` (``amp_cast``,
round to nearest-even).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mxnet as mx
from mxnet import autograd, gluon
from mxnet.ndarray import NDArray
from mxnet.symbol import Symbol

from mixprec.errors import MixprecWarning, WrapError
from mixprec.kit import BFLOAT16, FLOAT32, Policy, is_low_precision

from ..bf16_kernels import warn_islands
from ..blocks import BlockInfo, BlockTree, walk
from ..dtypes import cast, default_layout, dtype_name, mx_dtype
from ..gluon_private import clear_cached_graph, is_active, own_params, replace_param_data
from ..o1.graph import install_graph_pass
from ..ops import unsupported_natives
from .islands import chained_islands, converting, enter, install_op_islands, leave
from .symbol_blocks import fp32_params_by_op, install_symbol_islands

__all__ = [
    "ISLAND_BLOCKS",
    "BlockSite",
    "cast_floating",
    "cast_param",
    "convert_net",
    "needs_fp32_params",
    "param_dtypes",
    "param_dtypes_by_name",
    "plan_net",
    "plan_sites",
]

#: Gluon layers whose MXNet op has no bfloat16 CPU kernel: float32 islands under bfloat16.
ISLAND_BLOCKS = ("Dropout", "LayerNorm", "GroupNorm", "InstanceNorm", "_RNNLayer")
_FP32_PARAM_BLOCKS = ("_BatchNorm", "SyncBatchNorm")


def needs_fp32_params(info: BlockInfo) -> bool:
    """Whether MXNet's kernel for this block needs float32 parameters (BatchNorm's do)."""
    return any(name in _FP32_PARAM_BLOCKS for name in info.classes)


def _pinned(info: BlockInfo, policy: Policy, device: str) -> str | None:
    pinned = policy.module_dtype(info.path, info.classes)
    if pinned is None and policy.compute == BFLOAT16 and device == "cpu":
        if any(name in ISLAND_BLOCKS for name in info.classes):
            return FLOAT32
    return pinned


@dataclass(frozen=True)
class BlockSite:
    """One block of the net as the conversion sees it."""

    info: BlockInfo
    dtype: str
    """The dtype the block's parameters and (O2/O3) activations take: its own module rule's,
    else its parent's; the root's is the policy's ``param``."""
    outside: str | None
    """Set when the block is an island (its dtype differs from its parent's): the dtype
    around it, which its outputs are cast back to."""


def plan_net(net: gluon.Block, policy: Policy, device: str) -> list[BlockSite]:
    """Every block of ``net`` with its dtype, parents first."""
    return plan_sites(walk(net), policy, device)


def plan_sites(tree: BlockTree, policy: Policy, device: str) -> list[BlockSite]:
    """Every block of the walked net with its dtype, parents first."""
    net = tree.blocks[0].block
    around = {id(net): policy.param}
    sites = []
    for info, kids in zip(tree.blocks, tree.children, strict=True):
        outside = around[id(info.block)]
        dtype = (None if info.block is net else _pinned(info, policy, device)) or outside
        sites.append(BlockSite(info, dtype, outside if dtype != outside else None))
        for child in kids:
            around[id(tree.blocks[child].block)] = dtype
    return sites


def param_dtypes(
    tree: BlockTree, params: Sequence[gluon.Parameter], policy: Policy, device: str
) -> list[tuple[gluon.Parameter, str]]:
    """The dtype each of the walked net's parameters takes under ``policy``, in the order of
    ``params`` (the net's ``collect_params()``)."""
    chosen: dict[int, tuple[gluon.Parameter, str]] = {}
    for site in plan_sites(tree, policy, device):
        dtype = site.dtype
        if needs_fp32_params(site.info) and is_low_precision(dtype):
            dtype = FLOAT32
        by_op = fp32_params_by_op(site.info.block) if is_low_precision(dtype) else set()
        for param in own_params(site.info.block):
            chosen.setdefault(id(param), (param, FLOAT32 if param.name in by_op else dtype))
    return [chosen[id(p)] for p in params if id(p) in chosen]


def param_dtypes_by_name(params: Any, policy: Policy) -> list[tuple[gluon.Parameter, str]]:
    """The dtype each parameter of a ``ParameterDict`` (no blocks) takes under ``policy``: a
    parameter's module is its name, matched by path rules only, and BatchNorm parameters are
    recognised by name."""
    values = list(params.values())
    batch_norm = _batch_norm_params(values)
    return [
        (p, FLOAT32 if p.name in batch_norm else policy.param_dtype_for(p.name, None))
        for p in values
    ]


def _batch_norm_params(params: Sequence[gluon.Parameter]) -> set[str]:
    """Names of BatchNorm parameters, recognised by name as MXNet's ``SymbolBlock.cast`` does
    (``<prefix>running_var`` with ``running_mean``, ``gamma`` and ``beta`` siblings)."""
    names = {p.name for p in params}
    found: set[str] = set()
    for name in names:
        for var, mean in (("running_var", "running_mean"), ("moving_var", "moving_mean")):
            if name.endswith(var):
                group = {name, name[: -len(var)] + mean}
                group |= {name[: -len(var)] + s for s in ("gamma", "beta")}
                if group <= names:
                    found |= group
    return found


def cast_param(param: gluon.Parameter, dtype: str) -> None:
    """Cast ``param`` (data on every context, and its gradient buffers) to ``dtype``.

    Like ``Parameter.cast`` but rounding to nearest-even. Cast after initialisation: a
    parameter still waiting for its shape would only record the dtype, and MXNet's
    initializers cannot fill bfloat16 arrays.
    """
    if dtype_name(param.dtype) == dtype:
        return
    with autograd.pause():
        # the weights may be in a blocked layout after an inference forward pass
        replace_param_data(param, mx_dtype(dtype), lambda data: cast(default_layout(data), dtype))


def convert_net(
    net: gluon.Block,
    tree: BlockTree,
    params: Sequence[gluon.Parameter],
    policy: Policy,
    device: str,
    before_forward: Callable[[Sequence[Any]], None] | None = None,
) -> None:
    """Install the policy's casts on ``net`` in place (parameters are cast by the caller).

    :param tree: ``net`` walked (:func:`~mixprec_mxnet.blocks.walk`).
    :param params: ``net.collect_params()``'s parameters.
    :param before_forward: called with the inputs of every call, before any cast (the
        Trainer finishes deferred parameter initialisation at the first, and marks the
        accumulating parameters before each recorded one).
    """
    if policy.casts_ops:
        _install_op_casting(tree, 0, policy, device)
    else:
        _install_islands(tree, params, policy, device)
        for info in tree.blocks:  # a graph traced before the conversion runs float32
            clear_cached_graph(info.block)
    _install_boundary(net, policy, before_forward)
    if is_low_precision(policy.compute):
        warn_islands(policy.label, policy.compute, device)


def _install_op_casting(tree: BlockTree, index: int, policy: Policy, device: str) -> None:
    if is_low_precision(policy.param):
        raise WrapError(
            f"policy {policy.label} has op rules that cast and param={policy.param}: the Gluon "
            "backend casts ops only around float32 parameters (O1-style). Use O1 with op "
            "rules, or O2/O3 with module rules (policy.with_module(...)) instead of op rules"
        )
    block = tree.blocks[index].block
    if isinstance(block, gluon.HybridBlock):
        install_graph_pass(block, policy, device, tree.subtree(index))
        return
    for child in tree.children[index]:
        _install_op_casting(tree, child, policy, device)


def _install_islands(
    tree: BlockTree, net_params: Sequence[gluon.Parameter], policy: Policy, device: str
) -> None:
    params = {p.name: p for p in net_params}
    bf16_batch_norm = "BatchNorm" not in unsupported_natives(BFLOAT16, device)
    for site in plan_sites(tree, policy, device):
        if site.outside is not None:
            fused = (
                device == "cpu"
                and site.dtype == FLOAT32
                and site.outside == BFLOAT16
                and needs_fp32_params(site.info)
                and bf16_batch_norm
            )
            _wrap_island(site.info.block, site.dtype, site.outside, params if fused else None)
        if is_low_precision(site.dtype):
            missing = unsupported_natives(site.dtype, device)
            install_op_islands(site.info.block, missing, site.dtype)
            install_symbol_islands(site.info.block, missing, site.dtype)


def _blocked_conv_output(x: Any, params: Any) -> bool:
    """Whether the Symbol ``x`` is a ``Convolution`` whose oneDNN bfloat16 output is in a
    blocked layout, where BatchNorm reading it directly beats the cast island: input and
    output channels both multiples of 16. The input channels are ``weight.shape[1] *
    num_group`` (a depthwise convolution's weight has one per group). Measured on an
    AVX512-BF16 CPU (Zen 4, one thread, CPU time of forward + backward of Conv + BatchNorm +
    ReLU): depthwise 64 channels 56 ms read directly against 86 ms through the island,
    32 -> 32 ... 64 -> 128 likewise; 16 -> 24 or 24 -> 32 channels 81/115 ms directly against
    69/92 ms through the island, and a first layer's 3 channels 271 against 183 ms.

    Read once the weights have their shapes: the Trainer traces a deferred net again after
    finishing its initialisation, so that a net whose shapes were loaded and one whose shapes
    were inferred get the same graph (and resume bit for bit)."""
    graph = json.loads(x.tojson())
    nodes = graph["nodes"]
    head = nodes[graph["heads"][0][0]]
    if len(graph["heads"]) != 1 or head["op"] != "Convolution":
        return False
    attrs = head.get("attrs", {})
    if int(attrs.get("num_filter", "0")) % 16:
        return False
    weight = params.get(nodes[head["inputs"][1][0]]["name"]) if len(head["inputs"]) > 1 else None
    shape: tuple[int, ...] = ()
    if isinstance(weight, gluon.Parameter) and weight.shape:
        shape = tuple(weight.shape)
    if len(shape) > 1 and shape[1] > 0:
        return shape[1] * int(attrs.get("num_group", "1")) % 16 == 0
    data = nodes[head["inputs"][0][0]]  # channels not inferred yet: not on the net's input
    while data["op"] in ("amp_cast", "Cast"):
        data = nodes[data["inputs"][0][0]]
    return bool(data["op"] != "null")


def _wrap_island(block: gluon.Block, inside: str, outside: str, fused: Any = None) -> None:
    """Cast around ``block``; ``fused``: the net's parameters, for a float32 BatchNorm island
    in a bfloat16 net on the CPU."""
    if isinstance(block, gluon.HybridBlock):
        hybrid_forward = block.hybrid_forward

        def island(F: Any, x: Any, *args: Any, **params: Any) -> Any:
            if not converting():
                return hybrid_forward(F, x, *args, **params)
            if fused is not None and isinstance(x, Symbol) and _blocked_conv_output(x, fused):
                # MXNet's oneDNN BatchNorm on blocked bfloat16 data computes in float32 with
                # float32 gamma/beta/statistics: the island's two casts happen in the kernel
                # (5x faster than amp_cast + BatchNorm on plain NCHW float32).
                return hybrid_forward(F, x, **params)
            # enter/leave: a run of float32 islands passes float32 between them
            x, args = enter(x, inside), enter(args, inside)
            return leave(hybrid_forward(F, x, *args, **params), outside, inside)

        block.hybrid_forward = island
    else:
        forward = block.forward

        def island_forward(*args: Any) -> Any:
            if not converting():
                return forward(*args)
            return leave(forward(*enter(args, inside)), outside, inside)

        block.forward = island_forward


def _install_boundary(
    net: gluon.Block, policy: Policy, before: Callable[[Sequence[Any]], None] | None
) -> None:
    forward = net.forward
    in_dtype = None if policy.casts_ops else policy.param
    out_dtype = None if policy.casts_ops and policy.output == FLOAT32 else policy.output
    state: dict[str, Any] = {"before": before, "warned": False}
    graph_pass = policy.casts_ops and isinstance(net, gluon.HybridBlock)

    def boundary(*args: Any) -> Any:
        # the hook's shape inference traces the graph too: chain the islands in both traces
        with chained_islands():
            return convert_call(*args)

    def convert_call(*args: Any) -> Any:
        hook = state["before"]
        if hook is not None:
            hook(args)
        if graph_pass and not state["warned"] and not is_active(net):
            state["warned"] = True
            warnings.warn(
                f"policy {policy.label} casts ops in the hybridized graph, but "
                "net.hybridize(active=False) turned the graph off: the net runs in float32. "
                "Call net.hybridize() to train in mixed precision",
                MixprecWarning,
                stacklevel=3,
            )
        if in_dtype is not None:
            args = cast_floating(args, in_dtype)
        out = forward(*args)
        return out if out_dtype is None else cast_floating(out, out_dtype)

    net.forward = boundary


def cast_floating(value: Any, dtype: str) -> Any:
    """Floating NDArrays and Symbols in ``value`` (nested lists/tuples) cast to ``dtype``."""
    if isinstance(value, NDArray):
        return cast(value, dtype)
    if isinstance(value, Symbol):
        return mx.sym.amp_cast(value, dtype=mx_dtype(dtype))
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(v, dtype) for v in value)
    return value
