"""The map from mixprec's neutral op families to MXNet's native operators.

A graph node belongs to a family by its registered op name and, for the multi-purpose ops
(``Activation``, ``LeakyReLU``, ``Pooling``), by one attribute: ``Activation`` with
``act_type='relu'`` is ``relu``, with ``'tanh'`` it is ``tanh``. Policies may also name a
native op directly as ``"mxnet:<op name>"``; such a rule wins over the family's.

:func:`amp_lists` turns a policy into the four lists MXNet's graph pass
(``MXReducePrecisionSymbol``, behind ``mxnet.contrib.amp.convert_hybrid_block``) takes.
Native ops that no family covers keep MXNet's own AMP lists, because many of MXNet's CPU
kernels have no bfloat16 version (``transpose`` even crashes on it); those lists keep them
in float32.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from mxnet.contrib.amp.lists import symbol_bf16, symbol_fp16

from mixprec.kit import BFLOAT16, Policy

from .bf16_kernels import missing_bf16_cpu_ops

__all__ = [
    "FAMILY_OPS",
    "AmpLists",
    "NativeOp",
    "amp_lists",
    "family_of",
    "island_families",
    "island_natives",
    "native_name",
    "supported_families",
    "unsupported_natives",
]

PREFIX = "mxnet:"


@dataclass(frozen=True)
class NativeOp:
    """One MXNet operator, or the part of it selected by ``param`` being in ``values``."""

    name: str
    param: str | None = None
    values: tuple[str, ...] = ()

    def matches(self, op: str, attrs: Mapping[str, str]) -> bool:
        """Whether a node with this op name and attributes is this native op."""
        if op != self.name:
            return False
        return self.param is None or attrs.get(self.param) in self.values


def _ops(*names: str) -> tuple[NativeOp, ...]:
    return tuple(NativeOp(name) for name in names)


def _act(op: str, *values: str) -> NativeOp:
    param = "pool_type" if op == "Pooling" else "act_type"
    return NativeOp(op, param, values)


#: Neutral family -> the native ops that implement it (registered names, as graph nodes
#: carry them). Families missing here (``attention``, ``logsumexp``, ``nll_loss``, ``kl_div``,
#: ``cumsum``, ``silu``, ``addcmul``...) have no single MXNet 1.x operator.
FAMILY_OPS: dict[str, tuple[NativeOp, ...]] = {
    "linear": _ops("FullyConnected"),
    "matmul": _ops("dot", "_linalg_gemm2", "_linalg_gemm"),
    "bmm": _ops("batch_dot"),
    "conv": _ops("Convolution"),
    "conv_transpose": _ops("Deconvolution"),
    "rnn_cell": _ops("RNN"),
    "softmax": _ops("softmax"),
    "log_softmax": _ops("log_softmax"),
    "exp": _ops("exp", "expm1"),
    "log": _ops("log", "log1p", "log2", "log10"),
    "pow": _ops("_power", "broadcast_power", "_power_scalar", "_rpower_scalar"),
    "layer_norm": _ops("LayerNorm"),
    "group_norm": _ops("GroupNorm"),
    "batch_norm": _ops("BatchNorm", "_contrib_BatchNormWithReLU", "_contrib_SyncBatchNorm"),
    "instance_norm": _ops("InstanceNorm"),
    "norm": _ops("norm"),
    "sum": _ops("sum", "nansum"),
    "prod": _ops("prod", "nanprod"),
    "cross_entropy": _ops("softmax_cross_entropy", "SoftmaxOutput"),
    "mse_loss": _ops("LinearRegressionOutput"),
    "l1_loss": _ops("MAERegressionOutput"),
    "smooth_l1_loss": _ops("smooth_l1"),
    "binary_cross_entropy_with_logits": _ops("LogisticRegressionOutput"),
    "add": _ops("elemwise_add", "broadcast_add", "_grad_add", "ElementWiseSum"),
    "sub": _ops("elemwise_sub", "broadcast_sub"),
    "mul": _ops("elemwise_mul", "broadcast_mul"),
    "div": _ops("elemwise_div", "broadcast_div"),
    "cat": _ops("Concat"),
    "stack": _ops("stack"),
    "where": _ops("where"),
    "relu": (NativeOp("relu"), _act("Activation", "relu")),
    "gelu": (_act("LeakyReLU", "gelu"),),
    "sigmoid": (NativeOp("sigmoid"), _act("Activation", "sigmoid")),
    "tanh": (NativeOp("tanh"), _act("Activation", "tanh")),
    "dropout": _ops("Dropout"),
    "max_pool": (_act("Pooling", "max"),),
    "avg_pool": (_act("Pooling", "avg"),),
    "embedding": _ops("Embedding"),
}

#: Native ops whose CPU kernels reject bfloat16 in MXNet 1.9 (checked op by op): they run in
#: float32 under a bfloat16 policy whatever their family's rule says.
NO_BF16_ON_CPU: frozenset[str] = frozenset(
    {
        "dot", "_linalg_gemm2", "_linalg_gemm", "batch_dot", "RNN", "LayerNorm", "GroupNorm",
        "InstanceNorm", "Dropout", "softmax_cross_entropy", "SoftmaxOutput",
        "LinearRegressionOutput", "MAERegressionOutput", "LogisticRegressionOutput",
    }
)  # fmt: skip

#: Ops MXNet's pass does not cast to low precision even in the low-precision list.
LOWP_UNREACHABLE: frozenset[str] = frozenset({"Embedding"})

#: Ops MXNet's bfloat16 lists keep in float32 although their CPU kernels handle bfloat16
#: (checked forward and backward); casting around them would only cost time.
BF16_SHAPE_OPS: frozenset[str] = frozenset(
    {"Flatten", "Reshape", "expand_dims", "slice_axis", "SliceChannel", "_split_v2",
     "BlockGrad", "_copy", "identity"}
)  # fmt: skip

#: Ops with inputs they write to (BatchNorm's running statistics): MXNet's pass cannot put
#: them in the widest-type list, so ``promote`` acts as ``passthrough`` for them.
MUTATING_OPS: frozenset[str] = frozenset(
    {"BatchNorm", "_contrib_BatchNormWithReLU", "_contrib_SyncBatchNorm"}
)

_BY_NAME: dict[str, list[tuple[str, NativeOp]]] = {}
for _family, _natives in FAMILY_OPS.items():
    for _native in _natives:
        _BY_NAME.setdefault(_native.name, []).append((_family, _native))


def family_of(op: str, attrs: Mapping[str, str] = {}) -> str | None:
    """The neutral family of a graph node (by op name and attributes), or None."""
    for family, native in _BY_NAME.get(op, ()):
        if native.matches(op, attrs):
            return family
    return None


def native_name(op: str) -> str:
    """The ``"mxnet:<op>"`` name a policy uses for a native op."""
    return PREFIX + op


def island_natives(compute: str, device: str) -> frozenset[str]:
    """Native ops whose ``compute`` kernel is missing on this machine's ``device`` (probed:
    :func:`mixprec_mxnet.bf16_kernels.missing_bf16_cpu_ops`): they run as float32 islands."""
    if compute == BFLOAT16 and device == "cpu":
        return missing_bf16_cpu_ops()
    return frozenset()


def unsupported_natives(compute: str, device: str) -> frozenset[str]:
    """Native ops that cannot compute in ``compute`` on ``device`` (``"cpu"``, ``"gpu(0)"``):
    the ones with no kernel in any MXNet 1.9 build, plus those this machine lacks."""
    if compute == BFLOAT16 and device == "cpu":
        return NO_BF16_ON_CPU | island_natives(compute, device)
    return frozenset()


def island_families(compute: str, device: str) -> frozenset[str]:
    """Families that follow every rule except that, lacking a ``compute`` kernel on this
    machine, they compute in float32 where the rule says ``compute`` (a float32 island)."""
    missing = island_natives(compute, device)
    return frozenset(
        family
        for family, natives in FAMILY_OPS.items()
        if any(native.name in missing for native in natives)
        and all(native.param is None for native in natives)
    )


def supported_families(compute: str, device: str) -> frozenset[str]:
    """Families whose native ops follow every rule (any list) for ``compute`` on ``device``,
    computing in float32 where :func:`island_families` says the machine has no kernel.

    Left out: families with an op that has no ``compute`` kernel in MXNet at all, families
    picked out of a shared op by an attribute (``relu`` is ``Activation(act_type='relu')``:
    MXNet's pass can send those to float32 but not to low precision), and ``embedding``
    (``Embedding``'s ``dtype`` attribute pins its weight's type, so the pass leaves it be).
    Under their default rules (passthrough) these run as the policy says all the same.
    """
    bad = NO_BF16_ON_CPU if compute == BFLOAT16 and device == "cpu" else frozenset()
    bad = bad | LOWP_UNREACHABLE
    return frozenset(
        family
        for family, natives in FAMILY_OPS.items()
        if not any(native.name in bad or native.param is not None for native in natives)
    )


@dataclass
class AmpLists:
    """The lists MXNet's ReducePrecision pass takes, built from a policy.

    ``unhonoured`` names the native ops that cannot follow their family's rule on the device
    (no low-precision kernel there, so they run in float32), with that rule, for the warning
    the converter gives when a graph uses one.
    """

    target_dtype: str
    lowp: set[str] = field(default_factory=set)
    fp32: set[str] = field(default_factory=set)
    widest: set[str] = field(default_factory=set)
    conditional: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    unhonoured: dict[str, str] = field(default_factory=dict)

    def conditional_list(self) -> list[tuple[str, str, list[str]]]:
        """``conditional`` in the ``(op, param, values)`` form MXNet's API takes."""
        return [
            (op, param, sorted(values)) for (op, param), values in sorted(self.conditional.items())
        ]

    def _place(self, op: str, lst: str | None) -> None:
        for s in (self.lowp, self.fp32, self.widest):
            s.discard(op)
        if lst == "lowp":
            self.lowp.add(op)
        elif lst in ("fp32", "banned"):  # banned ops are refused before conversion
            self.fp32.add(op)
        elif lst == "promote" and op not in MUTATING_OPS:
            self.widest.add(op)


def _mxnet_defaults(
    target: str,
) -> tuple[Iterable[str], Iterable[str], Iterable[str], list[tuple[str, str, list[str]]]]:
    lists = symbol_bf16 if target == BFLOAT16 else symbol_fp16
    lowp = getattr(lists, "BF16_FUNCS", None) or getattr(lists, "FP16_FUNCS", [])
    return lowp, lists.FP32_FUNCS, lists.WIDEST_TYPE_CASTS, list(lists.CONDITIONAL_FP32_FUNCS)


def amp_lists(policy: Policy, device: str) -> AmpLists:
    """The graph-pass lists that make MXNet run each op the way ``policy``'s global rules say.

    Start from MXNet's own AMP lists (for ops no family covers), replace every mapped op by
    its family's list, apply ``"mxnet:<op>"`` rules, then force the ops the device cannot
    run in the compute dtype into float32. Module rules are applied per node by the caller.
    """
    target = policy.compute
    lowp, fp32, widest, conditional = _mxnet_defaults(target)
    out = AmpLists(target, set(lowp), set(fp32), set(widest))
    for op, param, values in conditional:
        mapped = {
            v for _, native in _BY_NAME.get(op, ()) if native.param == param for v in native.values
        }
        if set(values) - mapped:
            out.conditional[(op, param)] = set(values) - mapped
    if target == BFLOAT16:
        out.fp32 -= BF16_SHAPE_OPS
    for op, pairs in _BY_NAME.items():
        out._place(op, None)
        for family, native in pairs:
            lst = policy.ops.list_of(family)
            if native.param is None:
                out._place(op, lst)
            elif lst in ("fp32", "banned"):
                out.conditional.setdefault((op, native.param), set()).update(native.values)
            elif lst == "lowp":
                out.unhonoured[op] = (
                    f"{family} (lowp): MXNet's pass sends {op} by {native.param} to float32 only"
                )
    for op in LOWP_UNREACHABLE:
        family = next(f for f, _ in _BY_NAME[op])
        if policy.ops.list_of(family) == "lowp":
            out.unhonoured[op] = f"{family} (lowp): its dtype attribute keeps the weight's type"
    for name in policy.ops.listed:
        if name.startswith(PREFIX):
            out._place(name[len(PREFIX) :], policy.ops.list_of(name))
    islands = island_natives(target, device)  # the Trainer's island warning names these
    for op in unsupported_natives(target, device):
        owner = next((f for f, _ in _BY_NAME.get(op, ())), None)
        lst = policy.ops.list_of(native_name(op)) or (policy.ops.list_of(owner) if owner else None)
        if op not in out.fp32:
            out._place(op, "fp32")
            if lst in ("lowp", "promote") and op not in islands:
                out.unhonoured[op] = f"{owner or native_name(op)} ({lst})"
    return out
