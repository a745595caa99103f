"""The map from mixprec's neutral op families to PyTorch: callables and ATen operators.

:data:`ATEN_OPS` lists, for each family of :data:`mixprec.ops.OP_FAMILIES`, the ATen operator
overloads a call of the family reaches first in torch's dispatcher (``F.softmax``,
``torch.softmax`` and ``Tensor.softmax`` all reach ``aten::softmax.int``; ``a @ b`` reaches
``aten::matmul``). O1 decides dtypes there, at the Autocast dispatch key, as
``torch.autocast`` does (:mod:`mixprec_torch.o1.autocast_kernels`): a composite operator's own
decision covers the operators it runs (``aten::cross_entropy_loss`` decides for the ``log_softmax``
and ``nll_loss`` inside it), and a Python function is the operators it calls
(``F.multi_head_attention_forward`` is linears, a softmax and batched products, each decided
by its own family). :data:`TORCH_OPS` lists the Python callables of each family, for reading
and for the probes.

Native names: a policy may also list ``"torch:<name>"``; :mod:`mixprec_torch.o1.aten` resolves
them (and the families) to the overloads of this torch build.

The representative calls that test what each family produces (and
:func:`~mixprec_torch.o1.probes.autocast_dtypes`, which runs them) live in
:mod:`mixprec_torch.o1.probes`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from mixprec.kit import OP_FAMILIES

__all__ = ["ATEN_OPS", "NORM_ARGS", "TORCH_OPS", "supported_ops"]

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

#: Neutral family -> the ATen operator overloads its calls reach first (see the docstring).
ATEN_OPS: dict[str, tuple[str, ...]] = {
    "linear": ("linear", "bilinear", "addmm", "addmm.dtype"),
    "matmul": (
        "matmul",
        "mm",
        "mm.dtype",
        "mv",
        "dot",
        "vdot",
        "addmv",
        "inner",
        "outer",
        "einsum",
        "tensordot",
        "linalg_vecdot",
        "linalg_multi_dot",
        "chain_matmul",
    ),
    "bmm": ("bmm", "bmm.dtype", "baddbmm", "baddbmm.dtype", "addbmm"),
    "conv": (
        "conv1d",
        "conv1d.padding",
        "conv2d",
        "conv2d.padding",
        "conv3d",
        "conv3d.padding",
        "conv_tbc",
        "convolution",
    ),
    "conv_transpose": ("conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input"),
    "attention": ("scaled_dot_product_attention", "_native_multi_head_attention"),
    "rnn_cell": (
        "lstm_cell",
        "gru_cell",
        "rnn_tanh_cell",
        "rnn_relu_cell",
        "lstm.input",
        "lstm.data",
        "gru.input",
        "gru.data",
        "rnn_tanh.input",
        "rnn_tanh.data",
        "rnn_relu.input",
        "rnn_relu.data",
    ),
    "softmax": ("softmax.int", "special_softmax"),
    "log_softmax": ("log_softmax.int", "special_log_softmax"),
    "exp": ("exp",),
    "log": ("log",),
    "pow": ("pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar"),
    "layer_norm": ("layer_norm", "rms_norm"),
    "group_norm": ("group_norm",),
    "batch_norm": ("batch_norm",),
    "instance_norm": ("instance_norm",),
    "norm": (
        "norm.Scalar",
        "norm.ScalarOpt_dim",
        "norm.ScalarOpt_dim_dtype",
        "norm.ScalarOpt_dtype",
        "linalg_norm",
        "linalg_norm.ord_str",
        "linalg_vector_norm",
        "linalg_matrix_norm",
        "linalg_matrix_norm.str_ord",
        "frobenius_norm.dim",
        "nuclear_norm",
        "nuclear_norm.dim",
    ),
    "sum": ("sum", "sum.dim_IntList", "nansum"),
    "prod": ("prod", "prod.dim_int"),
    "cumsum": ("cumsum",),
    "logsumexp": ("logsumexp", "special_logsumexp"),
    "cross_entropy": ("cross_entropy_loss",),
    "nll_loss": ("nll_loss_nd", "nll_loss", "nll_loss2d"),
    "mse_loss": ("mse_loss",),
    "l1_loss": ("l1_loss",),
    "smooth_l1_loss": ("smooth_l1_loss",),
    "kl_div": ("kl_div",),
    "binary_cross_entropy_with_logits": ("binary_cross_entropy_with_logits",),
    "binary_cross_entropy": ("binary_cross_entropy",),
    "add": ("add.Tensor", "add.Scalar"),
    "sub": (
        "sub.Tensor",
        "sub.Scalar",
        "subtract.Tensor",
        "subtract.Scalar",
        "rsub.Tensor",
        "rsub.Scalar",
    ),
    "mul": ("mul.Tensor", "mul.Scalar", "multiply.Tensor", "multiply.Scalar"),
    "div": (
        "div.Tensor",
        "div.Scalar",
        "div.Tensor_mode",
        "div.Scalar_mode",
        "divide.Tensor",
        "divide.Scalar",
        "divide.Tensor_mode",
        "divide.Scalar_mode",
        "true_divide.Tensor",
        "true_divide.Scalar",
    ),
    "cat": ("cat", "concat", "concatenate"),
    "stack": ("stack",),
    "addcmul": ("addcmul",),
    "addcdiv": ("addcdiv",),
    "where": ("where.self", "where.ScalarOther", "where.ScalarSelf"),
    "relu": ("relu",),
    "gelu": ("gelu",),
    "silu": ("silu",),
    "sigmoid": ("sigmoid",),
    "tanh": ("tanh",),
    "dropout": ("dropout", "feature_dropout", "alpha_dropout"),
    "max_pool": (
        "max_pool1d",
        "max_pool2d",
        "max_pool3d",
        "max_pool2d_with_indices",
        "max_pool3d_with_indices",
        "adaptive_max_pool1d",
        "adaptive_max_pool2d",
        "adaptive_max_pool3d",
    ),
    "avg_pool": (
        "avg_pool1d",
        "avg_pool2d",
        "avg_pool3d",
        "adaptive_avg_pool1d",
        "adaptive_avg_pool2d",
        "adaptive_avg_pool3d",
    ),
    "embedding": ("embedding", "embedding_bag", "embedding_bag.padding_idx"),
}
assert set(ATEN_OPS) == set(TORCH_OPS), set(ATEN_OPS) ^ set(TORCH_OPS)

#: Batch and instance norm take running statistics that they update in place, and accept
#: float32 weights and statistics with a low-precision input: ATen operator -> (positions of
#: the statistics, positions of weight and bias).
NORM_ARGS: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "aten::batch_norm": ((3, 4), (1, 2)),
    "aten::instance_norm": ((3, 4), (1, 2)),
}


def supported_ops() -> tuple[str, ...]:
    """The neutral families this backend maps, in :data:`mixprec.ops.OP_FAMILIES` order."""
    return tuple(op for op in OP_FAMILIES if op in TORCH_OPS)
