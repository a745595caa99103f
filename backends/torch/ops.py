"""The map from mixprec's neutral op families to PyTorch callables, and autocast probes.

:data:`TORCH_OPS` lists, for each family of :data:`mixprec.ops.OP_FAMILIES`, the entry points
through which PyTorch code reaches it: ``torch.nn.functional`` functions, ``torch``
functions and ``Tensor`` methods (operators such as ``a @ b`` arrive as ``Tensor.matmul``).
The op-casting mode (:mod:`mixprec_torch.autocast`) intercepts these callables, never the
ATen ops beneath them: the first listed function a call reaches decides its family, so
``F.multi_head_attention_forward`` is one ``attention`` op and its inner linears and
softmax follow that decision.

Native names: a policy may also list ``"torch:<name>"``. ``<name>`` is looked up as a
``torch.nn.functional``, ``torch`` and ``Tensor`` attribute (all that exist are
intercepted); ``"torch:aten::addmm.out"`` drops the ``aten::`` namespace and the overload;
dotted paths such as ``"torch:torch.linalg.svd"`` or ``"torch:nn.functional.prelu"`` name one
callable.

:func:`autocast_dtypes` runs each family's representative calls under ``torch.autocast``
(or without it) and reports the dtype each produced, so the backend intercepts only the
families where autocast's built-in lists disagree with the policy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from mixprec.errors import PolicyError
from mixprec.ops import OP_FAMILIES

from .dtypes import dtype_name

__all__ = [
    "TORCH_OPS",
    "Probe",
    "autocast_dtypes",
    "callables_for",
    "family_of",
    "native_callables",
    "supported_ops",
]

T = torch.Tensor


def _existing(*names: str) -> tuple[Callable[..., Any], ...]:
    """The callables named ``module.attr`` that exist in this torch build."""
    roots = {"F": F, "torch": torch, "T": T, "linalg": torch.linalg, "special": torch.special}
    found = []
    for name in names:
        root, _, attr = name.partition(".")
        value = getattr(roots[root], attr, None)
        if value is not None and value not in found:
            found.append(value)
    return tuple(found)


#: Neutral family -> the PyTorch callables that implement it.
TORCH_OPS: dict[str, tuple[Callable[..., Any], ...]] = {
    "linear": _existing("F.linear", "F.bilinear", "torch.addmm", "T.addmm"),
    "matmul": _existing(
        "torch.matmul",
        "T.matmul",
        "T.__matmul__",
        "T.__rmatmul__",
        "linalg.matmul",
        "torch.mm",
        "T.mm",
        "torch.mv",
        "T.mv",
        "torch.dot",
        "T.dot",
        "torch.addmv",
        "torch.inner",
        "torch.outer",
        "torch.einsum",
        "torch.tensordot",
        "linalg.vecdot",
        "linalg.multi_dot",
        "torch.chain_matmul",
    ),
    "bmm": _existing(
        "torch.bmm", "T.bmm", "torch.baddbmm", "T.baddbmm", "torch.addbmm", "T.addbmm"
    ),
    "conv": _existing("F.conv1d", "F.conv2d", "F.conv3d", "torch.conv_tbc", "torch.convolution"),
    "conv_transpose": _existing("F.conv_transpose1d", "F.conv_transpose2d", "F.conv_transpose3d"),
    "attention": _existing("F.scaled_dot_product_attention", "F.multi_head_attention_forward"),
    "rnn_cell": _existing(
        "torch.lstm_cell",
        "torch.gru_cell",
        "torch.rnn_tanh_cell",
        "torch.rnn_relu_cell",
        "torch.lstm",
        "torch.gru",
        "torch.rnn_tanh",
        "torch.rnn_relu",
    ),
    "softmax": _existing("F.softmax", "torch.softmax", "T.softmax", "special.softmax", "F.softmin"),
    "log_softmax": _existing(
        "F.log_softmax", "torch.log_softmax", "T.log_softmax", "special.log_softmax"
    ),
    "exp": _existing("torch.exp", "T.exp"),
    "log": _existing("torch.log", "T.log"),
    "pow": _existing("torch.pow", "T.pow", "T.__pow__", "T.__rpow__"),
    "layer_norm": _existing("F.layer_norm", "torch.layer_norm", "F.rms_norm", "torch.rms_norm"),
    "group_norm": _existing("F.group_norm", "torch.group_norm"),
    "batch_norm": _existing("F.batch_norm", "torch.batch_norm"),
    "instance_norm": _existing("F.instance_norm", "torch.instance_norm"),
    "norm": _existing(
        "torch.norm",
        "T.norm",
        "linalg.norm",
        "linalg.vector_norm",
        "linalg.matrix_norm",
        "F.normalize",
    ),
    "sum": _existing("torch.sum", "T.sum", "torch.nansum", "T.nansum"),
    "prod": _existing("torch.prod", "T.prod"),
    "cumsum": _existing("torch.cumsum", "T.cumsum"),
    "logsumexp": _existing("torch.logsumexp", "T.logsumexp", "special.logsumexp"),
    "cross_entropy": _existing("F.cross_entropy"),
    "nll_loss": _existing("F.nll_loss"),
    "mse_loss": _existing("F.mse_loss"),
    "l1_loss": _existing("F.l1_loss"),
    "smooth_l1_loss": _existing("F.smooth_l1_loss"),
    "kl_div": _existing("F.kl_div"),
    "binary_cross_entropy_with_logits": _existing("F.binary_cross_entropy_with_logits"),
    "binary_cross_entropy": _existing("F.binary_cross_entropy"),
    "add": _existing("torch.add", "T.add", "T.__add__", "T.__radd__"),
    "sub": _existing(
        "torch.sub", "torch.subtract", "torch.rsub", "T.sub", "T.__sub__", "T.__rsub__"
    ),
    "mul": _existing("torch.mul", "torch.multiply", "T.mul", "T.__mul__", "T.__rmul__"),
    "div": _existing(
        "torch.div",
        "torch.divide",
        "torch.true_divide",
        "T.div",
        "T.__truediv__",
        "T.__rtruediv__",
        "T.__rdiv__",
    ),
    "cat": _existing("torch.cat", "torch.concat", "torch.concatenate"),
    "stack": _existing("torch.stack"),
    "addcmul": _existing("torch.addcmul", "T.addcmul"),
    "addcdiv": _existing("torch.addcdiv", "T.addcdiv"),
    "where": _existing("torch.where", "T.where"),
    "relu": _existing("F.relu", "torch.relu", "T.relu"),
    "gelu": _existing("F.gelu"),
    "silu": _existing("F.silu"),
    "sigmoid": _existing("torch.sigmoid", "T.sigmoid", "F.sigmoid"),
    "tanh": _existing("torch.tanh", "T.tanh", "F.tanh"),
    "dropout": _existing("F.dropout", "torch.dropout", "F.dropout1d", "F.dropout2d", "F.dropout3d"),
    "max_pool": _existing(
        "F.max_pool1d",
        "F.max_pool2d",
        "F.max_pool3d",
        "torch.max_pool1d",
        "torch.max_pool2d",
        "torch.max_pool3d",
        "F.adaptive_max_pool1d",
        "F.adaptive_max_pool2d",
        "F.adaptive_max_pool3d",
    ),
    "avg_pool": _existing(
        "F.avg_pool1d",
        "F.avg_pool2d",
        "F.avg_pool3d",
        "torch.avg_pool1d",
        "F.adaptive_avg_pool1d",
        "F.adaptive_avg_pool2d",
        "F.adaptive_avg_pool3d",
    ),
    "embedding": _existing("F.embedding", "torch.embedding", "F.embedding_bag"),
}
assert set(TORCH_OPS) <= set(OP_FAMILIES), set(TORCH_OPS) - set(OP_FAMILIES)

#: Batch and instance norm take running statistics that they update in place, and accept
#: float32 weights and statistics with a low-precision input: callable -> (positions of
#: the statistics, positions of weight and bias). Keywords use the names below.
NORM_ARGS: dict[Callable[..., Any], tuple[tuple[int, int], tuple[int, int]]] = {
    F.batch_norm: ((1, 2), (3, 4)),
    torch.batch_norm: ((3, 4), (1, 2)),
    F.instance_norm: ((1, 2), (3, 4)),
    torch.instance_norm: ((3, 4), (1, 2)),
}
NORM_STATS_KW = ("running_mean", "running_var")
NORM_PARAMS_KW = ("weight", "bias")

_FAMILY_OF: dict[Callable[..., Any], str] = {
    fn: family for family, fns in TORCH_OPS.items() for fn in fns
}


def supported_ops() -> tuple[str, ...]:
    """The neutral families this backend maps, in :data:`mixprec.ops.OP_FAMILIES` order."""
    return tuple(op for op in OP_FAMILIES if op in TORCH_OPS)


def family_of(fn: Callable[..., Any]) -> str | None:
    """The family a torch callable belongs to, or None."""
    return _FAMILY_OF.get(fn)


@functools.cache
def native_callables(name: str) -> tuple[Callable[..., Any], ...]:
    """The callables a ``"torch:<name>"`` op names (see the module docstring).

    :raises PolicyError: nothing in this torch build has that name.
    """
    native = name.split(":", 1)[1] if name.startswith("torch:") else name
    if native.startswith("aten::"):
        native = native[len("aten::") :].split(".", 1)[0]
    found: list[Callable[..., Any]] = []
    if "." in native:
        parts = native.split(".")
        obj: Any = torch
        for part in parts[1:] if parts[0] == "torch" else parts:
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is not None and callable(obj):
            found.append(obj)
    else:
        for root in (F, torch, T):
            value = getattr(root, native, None)
            if value is not None and callable(value) and value not in found:
                found.append(value)
    if not found:
        raise PolicyError(
            f"op {name!r}: torch {torch.__version__} has no torch.nn.functional, torch or Tensor "
            f"callable named {native!r}; name a neutral family or an existing callable, such as "
            "'torch:aten::addmm', 'torch:prelu' or 'torch:torch.linalg.svd'"
        )
    return tuple(found)


def callables_for(op: str) -> tuple[Callable[..., Any], ...]:
    """The torch callables of a neutral family or a ``"torch:"`` name (other backends' native
    names map to nothing here)."""
    if op in TORCH_OPS:
        return TORCH_OPS[op]
    if op.startswith("torch:"):
        return native_callables(op)
    return ()


# ------------------------------------------------------------------------------------------
# Probes: what a family's calls produce, under autocast or without it
# ------------------------------------------------------------------------------------------

#: A probe runs one representative call with its floating inputs in the given dtypes.
Probe = tuple[int, Callable[[Sequence[torch.dtype], torch.device], Any]]


def _t(
    dtype: torch.dtype, device: torch.device, *shape: int, positive: bool = False
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(shape) + 7)
    value = torch.rand(*shape, generator=gen) if positive else torch.randn(*shape, generator=gen)
    return (value * 0.5 + (0.25 if positive else 0.0)).to(device=device, dtype=dtype)


def _lstm(ds: Sequence[torch.dtype], dev: torch.device) -> Any:
    x = _t(ds[0], dev, 2, 1, 4)
    h = _t(ds[1], dev, 1, 1, 3)
    c = _t(ds[1], dev, 1, 1, 3)
    params = [_t(ds[2], dev, 12, 4), _t(ds[2], dev, 12, 3), _t(ds[2], dev, 12), _t(ds[2], dev, 12)]
    return torch.lstm(x, (h, c), params, True, 1, 0.0, False, False, False)


def _mha(ds: Sequence[torch.dtype], dev: torch.device) -> Any:
    q = _t(ds[0], dev, 3, 1, 4)
    w_in, b_in = _t(ds[1], dev, 12, 4), _t(ds[1], dev, 12)
    w_out, b_out = _t(ds[1], dev, 4, 4), _t(ds[1], dev, 4)
    return F.multi_head_attention_forward(
        q,
        q,
        q,
        4,
        2,
        w_in,
        b_in,
        None,
        None,
        False,
        0.0,
        w_out,
        b_out,
        training=False,
        need_weights=False,
    )


def _ints(dev: torch.device, n: int, high: int) -> torch.Tensor:
    return torch.arange(n, device=dev) % high


# n = how many floating inputs the call takes (the dtypes it is probed with)
PROBES: dict[str, tuple[Probe, ...]] = {
    "linear": (
        (3, lambda ds, d: F.linear(_t(ds[0], d, 4, 8), _t(ds[1], d, 3, 8), _t(ds[2], d, 3))),
        (3, lambda ds, d: torch.addmm(_t(ds[0], d, 3), _t(ds[1], d, 4, 8), _t(ds[2], d, 8, 3))),
    ),
    "matmul": (
        (2, lambda ds, d: torch.matmul(_t(ds[0], d, 4, 8), _t(ds[1], d, 8, 3))),
        (2, lambda ds, d: torch.mm(_t(ds[0], d, 4, 8), _t(ds[1], d, 8, 3))),
    ),
    "bmm": (
        (2, lambda ds, d: torch.bmm(_t(ds[0], d, 2, 4, 8), _t(ds[1], d, 2, 8, 3))),
        (
            3,
            lambda ds, d: torch.baddbmm(
                _t(ds[0], d, 2, 4, 3), _t(ds[1], d, 2, 4, 8), _t(ds[2], d, 2, 8, 3)
            ),
        ),
    ),
    "conv": (
        (
            3,
            lambda ds, d: F.conv2d(
                _t(ds[0], d, 1, 2, 5, 5), _t(ds[1], d, 3, 2, 3, 3), _t(ds[2], d, 3)
            ),
        ),
        (3, lambda ds, d: F.conv1d(_t(ds[0], d, 1, 2, 5), _t(ds[1], d, 3, 2, 3), _t(ds[2], d, 3))),
    ),
    "conv_transpose": (
        (
            3,
            lambda ds, d: F.conv_transpose2d(
                _t(ds[0], d, 1, 2, 5, 5), _t(ds[1], d, 2, 3, 3, 3), _t(ds[2], d, 3)
            ),
        ),
    ),
    "attention": (
        (
            3,
            lambda ds, d: F.scaled_dot_product_attention(
                _t(ds[0], d, 1, 2, 4, 8), _t(ds[1], d, 1, 2, 4, 8), _t(ds[2], d, 1, 2, 4, 8)
            ),
        ),
        (2, _mha),
    ),
    "rnn_cell": (
        (
            6,
            lambda ds, d: torch.gru_cell(
                _t(ds[0], d, 2, 4),
                _t(ds[1], d, 2, 3),
                _t(ds[2], d, 9, 4),
                _t(ds[3], d, 9, 3),
                _t(ds[4], d, 9),
                _t(ds[5], d, 9),
            ),
        ),
        (3, _lstm),
    ),
    "softmax": ((1, lambda ds, d: F.softmax(_t(ds[0], d, 4, 8), dim=-1)),),
    "log_softmax": ((1, lambda ds, d: F.log_softmax(_t(ds[0], d, 4, 8), dim=-1)),),
    "exp": ((1, lambda ds, d: torch.exp(_t(ds[0], d, 4, 8))),),
    "log": ((1, lambda ds, d: torch.log(_t(ds[0], d, 4, 8, positive=True))),),
    "pow": ((1, lambda ds, d: torch.pow(_t(ds[0], d, 4, 8), 2.0)),),
    "layer_norm": (
        (3, lambda ds, d: F.layer_norm(_t(ds[0], d, 4, 8), (8,), _t(ds[1], d, 8), _t(ds[2], d, 8))),
    ),
    "group_norm": (
        (3, lambda ds, d: F.group_norm(_t(ds[0], d, 2, 4, 3), 2, _t(ds[1], d, 4), _t(ds[2], d, 4))),
    ),
    "batch_norm": (
        (
            3,
            lambda ds, d: F.batch_norm(
                _t(ds[0], d, 4, 3),
                torch.zeros(3, device=d, dtype=ds[1]),
                torch.ones(3, device=d, dtype=ds[1]),
                _t(ds[2], d, 3),
                _t(ds[2], d, 3),
                training=True,
            ),
        ),
    ),
    "instance_norm": (
        (
            3,
            lambda ds, d: F.instance_norm(
                _t(ds[0], d, 2, 3, 4), weight=_t(ds[1], d, 3), bias=_t(ds[2], d, 3)
            ),
        ),
    ),
    "norm": (
        (1, lambda ds, d: torch.norm(_t(ds[0], d, 4, 8))),
        (1, lambda ds, d: torch.linalg.vector_norm(_t(ds[0], d, 4, 8))),
        (1, lambda ds, d: F.normalize(_t(ds[0], d, 4, 8))),
    ),
    "sum": ((1, lambda ds, d: torch.sum(_t(ds[0], d, 4, 8))),),
    "prod": ((1, lambda ds, d: torch.prod(_t(ds[0], d, 4, 8, positive=True))),),
    "cumsum": ((1, lambda ds, d: torch.cumsum(_t(ds[0], d, 4, 8), 0)),),
    "logsumexp": ((1, lambda ds, d: torch.logsumexp(_t(ds[0], d, 4, 8), 0)),),
    "cross_entropy": ((1, lambda ds, d: F.cross_entropy(_t(ds[0], d, 4, 5), _ints(d, 4, 5))),),
    "nll_loss": ((1, lambda ds, d: F.nll_loss(_t(ds[0], d, 4, 5), _ints(d, 4, 5))),),
    "mse_loss": ((2, lambda ds, d: F.mse_loss(_t(ds[0], d, 4, 5), _t(ds[1], d, 4, 5))),),
    "l1_loss": ((2, lambda ds, d: F.l1_loss(_t(ds[0], d, 4, 5), _t(ds[1], d, 4, 5))),),
    "smooth_l1_loss": (
        (2, lambda ds, d: F.smooth_l1_loss(_t(ds[0], d, 4, 5), _t(ds[1], d, 4, 5))),
    ),
    "kl_div": (
        (
            2,
            lambda ds, d: F.kl_div(
                _t(ds[0], d, 4, 5), _t(ds[1], d, 4, 5, positive=True), reduction="batchmean"
            ),
        ),
    ),
    "binary_cross_entropy_with_logits": (
        (
            2,
            lambda ds, d: F.binary_cross_entropy_with_logits(
                _t(ds[0], d, 4, 5), _t(ds[1], d, 4, 5, positive=True)
            ),
        ),
    ),
    "binary_cross_entropy": (
        (
            2,
            lambda ds, d: F.binary_cross_entropy(
                _t(ds[0], d, 4, 5, positive=True), _t(ds[1], d, 4, 5, positive=True)
            ),
        ),
    ),
    "add": ((2, lambda ds, d: _t(ds[0], d, 4, 8) + _t(ds[1], d, 4, 8)),),
    "sub": ((2, lambda ds, d: _t(ds[0], d, 4, 8) - _t(ds[1], d, 4, 8)),),
    "mul": ((2, lambda ds, d: _t(ds[0], d, 4, 8) * _t(ds[1], d, 4, 8)),),
    "div": ((2, lambda ds, d: _t(ds[0], d, 4, 8) / _t(ds[1], d, 4, 8, positive=True)),),
    "cat": ((2, lambda ds, d: torch.cat([_t(ds[0], d, 4, 8), _t(ds[1], d, 4, 8)])),),
    "stack": ((2, lambda ds, d: torch.stack([_t(ds[0], d, 4, 8), _t(ds[1], d, 4, 8)])),),
    "addcmul": (
        (
            3,
            lambda ds, d: torch.addcmul(_t(ds[0], d, 4, 8), _t(ds[1], d, 4, 8), _t(ds[2], d, 4, 8)),
        ),
    ),
    "addcdiv": (
        (
            3,
            lambda ds, d: torch.addcdiv(
                _t(ds[0], d, 4, 8), _t(ds[1], d, 4, 8), _t(ds[2], d, 4, 8, positive=True)
            ),
        ),
    ),
    "where": (
        (2, lambda ds, d: torch.where(_ints(d, 8, 2) > 0, _t(ds[0], d, 4, 8), _t(ds[1], d, 4, 8))),
    ),
    "relu": ((1, lambda ds, d: F.relu(_t(ds[0], d, 4, 8))),),
    "gelu": ((1, lambda ds, d: F.gelu(_t(ds[0], d, 4, 8))),),
    "silu": ((1, lambda ds, d: F.silu(_t(ds[0], d, 4, 8))),),
    "sigmoid": ((1, lambda ds, d: torch.sigmoid(_t(ds[0], d, 4, 8))),),
    "tanh": ((1, lambda ds, d: torch.tanh(_t(ds[0], d, 4, 8))),),
    "dropout": ((1, lambda ds, d: F.dropout(_t(ds[0], d, 4, 8), 0.5, training=True)),),
    "max_pool": ((1, lambda ds, d: F.max_pool2d(_t(ds[0], d, 1, 1, 4, 4), 2)),),
    "avg_pool": ((1, lambda ds, d: F.avg_pool2d(_t(ds[0], d, 1, 1, 4, 4), 2)),),
    "embedding": ((1, lambda ds, d: F.embedding(_ints(d, 3, 5), _t(ds[0], d, 5, 4))),),
}
assert set(PROBES) == set(TORCH_OPS), set(PROBES) ^ set(TORCH_OPS)


def result_dtype(out: Any) -> torch.dtype:
    """The dtype of a call's result: its first floating tensor (tuples are searched)."""
    if isinstance(out, torch.Tensor):
        return out.dtype
    if isinstance(out, (tuple, list)):
        for item in out:
            if item is None:
                continue
            try:
                return result_dtype(item)
            except TypeError:
                continue
    raise TypeError(f"no tensor in the result {type(out).__name__}")


def probe_configs(n: int, lowp: torch.dtype) -> list[tuple[torch.dtype, ...]]:
    """The input-dtype combinations a probe with ``n`` floating inputs is run with: all
    float32, all bfloat16, all float16, and ``lowp`` mixed with float32 both ways."""
    configs = [(dtype,) * n for dtype in (torch.float32, torch.bfloat16, torch.float16)]
    if n > 1:
        configs += [(lowp,) + (torch.float32,) * (n - 1), (torch.float32,) + (lowp,) * (n - 1)]
    return configs


#: (family, probe index, input dtype names) -> the dtype name it produced, or None: it raised
ProbeResults = dict[tuple[str, int, tuple[str, ...]], str | None]


@functools.cache
def autocast_dtypes(
    device_type: str, autocast: torch.dtype | None, lowp: torch.dtype
) -> ProbeResults:
    """Run every family's probes on ``device_type``, under ``torch.autocast(device_type,
    autocast)`` (or without autocast when it is None), with the inputs of
    :func:`probe_configs`.

    Cached per arguments; the probes are tiny tensors on the device itself (the first call
    in a process mostly pays for PyTorch's one-time kernel initialisation).
    """
    results: ProbeResults = {}
    for family, probes in PROBES.items():
        for index, (n, _) in enumerate(probes):
            for config in probe_configs(n, lowp):
                key = (family, index, tuple(dtype_name(d) for d in config))
                results[key] = probe(device_type, autocast, family, index, config)
    return results


@functools.cache
def probe(
    device_type: str,
    autocast: torch.dtype | None,
    family: str,
    index: int,
    config: tuple[torch.dtype, ...],
) -> str | None:
    """The dtype one probe call produces (None: the op refused these inputs)."""
    device = torch.device(device_type)
    run = PROBES[family][index][1]
    ctx = (
        torch.autocast(device_type, dtype=autocast)
        if autocast is not None
        else torch.autocast(device_type, enabled=False)
    )
    devices = [device.index or 0] if device_type == "cuda" else []
    # dropout's probe draws random numbers: keep the caller's RNG streams untouched
    with torch.random.fork_rng(devices=devices), torch.no_grad(), ctx:
        try:
            return dtype_name(result_dtype(run(config, device)))
        except Exception:  # the native op refuses this combination
            return None
