"""The ``torch-autocast`` presets: policies equal to ``torch.autocast``'s own op lists.

``wrap(model, optimizer, policy="torch-autocast-cpu")`` reproduces
``torch.autocast("cpu")`` + ``torch.amp.GradScaler("cpu")``: the neutral families are put in
the list whose rule gives the dtype autocast produces for them, nothing is pinned (autocast
has no BatchNorm rule), and the loss scale is ``DynamicScale(skip="optimizer")``, whose defaults are
``GradScaler``'s (init 2**16, growth 2, backoff 0.5, interval 2000). Ops outside the neutral
vocabulary keep autocast's built-in handling, because the backend runs autocast underneath
and intercepts only what the policy names differently.

=========================  =========  ====================================================
preset                     compute    lists from
=========================  =========  ====================================================
``torch-autocast-cpu``     bfloat16   CPU autocast (``torch.autocast("cpu")``'s default)
``torch-autocast-cuda``    float16    CUDA autocast (``torch.autocast("cuda")``'s default)
``torch-autocast``         either     CUDA's when ``torch.cuda.is_available()``, else CPU's
=========================  =========  ====================================================

Override the dtype as usual: ``wrap(..., policy="torch-autocast-cpu", compute="float16")``
is ``torch.autocast("cpu", dtype=torch.float16)``. Outputs are cast to float32 at the model
boundary (a loss autocast computes in float32 gets identical values). Drop the scaler for
bfloat16 with ``loss_scale="none"``.

The tables are transcribed from autocast's lists (``aten/src/ATen/autocast_mode.cpp``) as
torch 2.13 behaves; ``tests/torch/test_presets.py`` checks the CPU table against autocast
itself, and a CUDA-marked test the CUDA table. One family cannot be expressed exactly on
CPU: autocast casts ``torch.lstm``/``torch.gru`` (what ``nn.LSTM``/``nn.GRU`` call) but not
``torch.gru_cell``/``torch.lstm_cell``; ``rnn_cell`` is ``lowp`` here, so the backend runs
the cell functions in low precision too. And CPU autocast's promote rule raises for inputs in
the *other* low-precision dtype (``torch.cat`` of float16 tensors under bfloat16 autocast),
so ``cat`` and ``stack`` are run by the backend with the policy's promote rule (same values
wherever autocast itself runs).
"""

from __future__ import annotations

from mixprec.kit import OP_FAMILIES, DynamicScale, OpRules, Policy

__all__ = ["AUTOCAST_LISTS", "torch_autocast_policy", "torch_autocast_presets"]

_LOWP = ("linear", "matmul", "bmm", "conv", "conv_transpose", "attention", "rnn_cell")
_PROMOTE = ("add", "sub", "mul", "div", "cat", "stack", "addcmul", "addcdiv", "where")
_LOSSES = (
    "cross_entropy",
    "nll_loss",
    "mse_loss",
    "l1_loss",
    "smooth_l1_loss",
    "kl_div",
    "binary_cross_entropy_with_logits",
)

#: device type -> list name -> families (every family not named passes through)
AUTOCAST_LISTS: dict[str, dict[str, tuple[str, ...]]] = {
    "cpu": {
        "lowp": _LOWP,
        "fp32": ("prod", *_LOSSES, "binary_cross_entropy"),
        "promote": _PROMOTE,
        "banned": (),
    },
    "cuda": {
        "lowp": _LOWP,
        "fp32": (
            "softmax",
            "log_softmax",
            "exp",
            "log",
            "pow",
            "layer_norm",
            "group_norm",
            "norm",
            "sum",
            "prod",
            "cumsum",
            "logsumexp",
            *_LOSSES,
        ),
        "promote": _PROMOTE,
        "banned": ("binary_cross_entropy",),
    },
}

_DEFAULT_DTYPE = {"cpu": "bfloat16", "cuda": "float16"}


def torch_autocast_policy(device_type: str) -> Policy:
    """The policy equal to ``torch.autocast(device_type)`` + ``GradScaler()`` defaults."""
    lists = AUTOCAST_LISTS[device_type]
    named = {op for ops in lists.values() for op in ops}
    ops = OpRules(
        lowp=lists["lowp"],
        fp32=lists["fp32"],
        promote=lists["promote"],
        banned=lists["banned"],
        passthrough=[op for op in OP_FAMILIES if op not in named],
    )
    compute = _DEFAULT_DTYPE[device_type]
    return Policy(
        param="float32",
        compute=compute,
        output="float32",
        master=None,
        reduce="float32",
        loss_scale=DynamicScale(skip="optimizer"),  # GradScaler skips per optimizer
        ops=ops,
        modules=(),
    )


def torch_autocast_presets() -> dict[str, Policy]:
    """``torch-autocast-cpu``, ``torch-autocast-cuda`` and ``torch-autocast`` (this machine's)."""
    import torch

    cpu, cuda = torch_autocast_policy("cpu"), torch_autocast_policy("cuda")
    return {
        "torch-autocast-cpu": cpu,
        "torch-autocast-cuda": cuda,
        "torch-autocast": cuda if torch.cuda.is_available() else cpu,
    }
