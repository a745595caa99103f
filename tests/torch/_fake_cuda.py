"""A simulated CUDA device for the tests that check the CUDA paths without a GPU.

On a CPU-only torch build, tensors made under
:class:`torch._subclasses.fake_tensor.FakeTensorMode` can live on ``cuda``: they carry a
device, dtype and shape but no data, and every op on them runs torch's real dispatch
(autocast's ``AutocastCUDA`` kernels included) down to the meta kernels. What the build
cannot answer is ``torch.cuda``'s questions about the hardware (is there a device, its
compute capability, its RNG state): :func:`fake_cuda` answers them for one device of the
compute capability given, and nothing else is replaced: mixprec's code and torch's
autocast run as they are.

What cannot run here: anything that needs values (loss scaling's ``found_inf``, the
optimizer step, checkpoints) and autograd on CUDA parameters (recording a backward node
for a fake CUDA tensor that requires grad aborts the process in the device guard: the
build has no CUDA guard). So the models' parameters are made with ``requires_grad=False``
and only forward passes run; ``make gpu-check`` runs the rest on a real GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import mixprec.torch as mpt
from mixprec_torch import devices


@contextlib.contextmanager
def fake_cuda(major: int = 8, minor: int = 0) -> Iterator[FakeTensorMode]:
    """One simulated CUDA device ``cuda:0`` of compute capability ``major.minor``, and the
    fake mode in which tensors can be made on it. ``capabilities()`` is re-read on entry
    and on exit, so it lists the device only inside."""
    props = SimpleNamespace(major=major, minor=minor, name=f"simulated sm_{major}{minor}")
    hardware = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "get_device_capability": lambda device=None: (major, minor),
        "get_device_properties": lambda device=None: props,
        # torch.random.fork_rng (the probes) saves and restores the device's generator
        "get_rng_state": lambda device="cuda": torch.zeros(16, dtype=torch.uint8),
        "set_rng_state": lambda state, device="cuda": None,
    }
    with contextlib.ExitStack() as stack:
        for name, answer in hardware.items():
            stack.enter_context(mock.patch.object(torch.cuda, name, answer))
        # A few Tensor methods bind through hand-written C++ that takes a CUDA device guard,
        # which a CPU-only build lacks; their ATen ops run in the fake mode. Among them
        # tensor.to("cuda"): the probes make their inputs on the CPU and move them (the
        # simulated host-to-device copy).
        for name, method in _GUARDED.items():
            stack.enter_context(mock.patch.object(torch.Tensor, name, method))
        devices.capabilities.cache_clear()
        stack.callback(devices.capabilities.cache_clear)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            yield mode


_TENSOR_TO = torch.Tensor.to


def _to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
    if device is not None and device.type == "cuda" and self.device.type != "cuda":
        return torch.ops.aten._to_copy(self, dtype=dtype, device=device, non_blocking=non_blocking)
    return _TENSOR_TO(self, *args, **kwargs)


def _copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    return torch.ops.aten.copy_(self, src, non_blocking)


def _contiguous(
    self: torch.Tensor, memory_format: torch.memory_format = torch.contiguous_format
) -> torch.Tensor:
    return torch.ops.aten.contiguous(self, memory_format=memory_format)


#: the Tensor methods whose Python bindings (hand-written in torch/csrc) take a device guard
_GUARDED = {"to": _to, "copy_": _copy_, "contiguous": _contiguous}


def to_fake_cuda(model: nn.Module) -> nn.Module:
    """Give every parameter and buffer of ``model`` an empty twin on the fake ``cuda:0``
    (same shape and dtype, no gradient: see the module docstring). Call inside
    :func:`fake_cuda`; ``model`` may be built on the ``meta`` device."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            twin = torch.empty(param.shape, dtype=param.dtype, device="cuda")
            setattr(module, name, nn.Parameter(twin, requires_grad=False))
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer is not None:  # setattr keeps the buffer's persistence
                setattr(module, name, torch.empty(buffer.shape, dtype=buffer.dtype, device="cuda"))
    return model


# ------------------------------------------- one model, its dtypes on the CPU and on CUDA


class Block(nn.Module):
    """Conv → BatchNorm → Linear → GELU → LayerNorm → attention → Linear → softmax: lowp
    families, a module pin (BatchNorm), and fp32 families that CUDA autocast runs in float32
    itself and CPU autocast does not (so O1 intercepts different families per device)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv(x)).flatten(2)  # (batch, 4, 16)
        h = self.norm(torch.nn.functional.gelu(self.fc(h)))
        q = h.unsqueeze(1)  # one head
        h = torch.nn.functional.scaled_dot_product_attention(q, q, q).squeeze(1)
        return torch.softmax(self.head(h), dim=-1)


def dtype_flow(model: nn.Module, x: torch.Tensor) -> dict[str, tuple[str, str]]:
    """Each named module's (input dtype, output dtype) in one forward pass, and the output's."""
    seen: dict[str, tuple[str, str]] = {}

    def record(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[object, ...], out: object) -> None:
            out = out[0] if isinstance(out, tuple) else out
            seen[name] = (str(args[0].dtype), str(out.dtype))  # type: ignore[attr-defined]

        return hook

    for name, module in model.named_modules():
        if name and "." not in name:
            module.register_forward_hook(record(name))
    with torch.no_grad():
        seen["(output)"] = ("", str(model(x).dtype))
    return seen


def cpu_flow(policy: str) -> dict[str, tuple[str, str]]:
    """:func:`dtype_flow` of a :class:`Block` wrapped with ``policy`` on the CPU."""
    torch.manual_seed(0)
    model = mpt.wrap(Block().train().requires_grad_(False), policy=policy)
    return dtype_flow(model, torch.randn(2, 3, 6, 6))
