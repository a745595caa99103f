"""Probes: what each op family's calls produce, under ``torch.autocast`` or without it.

:data:`PROBES` holds, for each family of :data:`mixprec_torch.ops.TORCH_OPS`, one or more
representative calls on tiny tensors whose floating inputs take the dtypes they are given.
:func:`autocast_dtypes` runs them with the input dtypes of :func:`probe_configs` and reports
the dtype each produced, so the op-casting mode intercepts only the families where
autocast's built-in lists disagree with the policy; the conformance adapter and the tests
run the same calls to check what a policy makes of each family.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..dtypes import dtype_name
from ..ops import TORCH_OPS

__all__ = [
    "PROBES",
    "Probe",
    "ProbeResults",
    "autocast_dtypes",
    "probe",
    "probe_configs",
    "result_dtype",
]

#: A probe runs one representative call with its floating inputs in the given dtypes.
Probe = tuple[int, Callable[[Sequence[torch.dtype], torch.device], Any]]


def _t(
    dtype: torch.dtype, device: torch.device, *shape: int, positive: bool = False
) -> torch.Tensor:
    # Made on the device itself, without a CPU generator to copy from: so the probes also
    # run on fake CUDA tensors (mixprec_torch.o1.framework_autocast), where a copy to CUDA is
    # refused.
    low, high = (0.25, 0.75) if positive else (-1.0, 1.0)
    count = 1
    for size in shape:
        count *= size
    return torch.linspace(low, high, count, device=device, dtype=dtype).reshape(shape)


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
    device_type: str,
    autocast: torch.dtype | None,
    lowp: torch.dtype,
    foreign: frozenset[str] = frozenset(),
) -> ProbeResults:
    """Run every family's probes on ``device_type``, under ``torch.autocast(device_type,
    autocast)`` (or without autocast when it is None), with the inputs of
    :func:`probe_configs`.

    Cached per arguments; the probes are tiny tensors on the device itself (the first call
    in a process mostly pays for PyTorch's one-time kernel initialisation). ``foreign``
    names the kernels of other libraries at the Autocast key while probing
    (:func:`mixprec_torch.o1.autocast_kernels.foreign`): the probes run through them, so what they
    measured holds only while exactly those are registered.
    """
    results: ProbeResults = {}
    for family, probes in PROBES.items():
        for index, (n, _) in enumerate(probes):
            for config in probe_configs(n, lowp):
                key = (family, index, tuple(dtype_name(d) for d in config))
                results[key] = _run(device_type, autocast, family, index, config)
    return results


@functools.cache
def probe(
    device_type: str,
    autocast: torch.dtype | None,
    family: str,
    index: int,
    config: tuple[torch.dtype, ...],
) -> str | None:
    """The dtype one probe call produces (None: the op refused these inputs); cached, so
    for calls without autocast only (no kernel at the Autocast key runs)."""
    return _run(device_type, autocast, family, index, config)


def _run(
    device_type: str,
    autocast: torch.dtype | None,
    family: str,
    index: int,
    config: tuple[torch.dtype, ...],
) -> str | None:
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


# Every mapped family has probes, so autocast_dtypes and the conformance run cover it.
assert set(PROBES) == set(TORCH_OPS), set(PROBES) ^ set(TORCH_OPS)
