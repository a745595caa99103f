"""The torch backend's plugin module (entry point ``torch`` in the ``mixprec`` group).

It declares the backend and its presets without importing torch at module level; the user
API lives in :mod:`mixprec_torch` and is imported on first use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mixprec.kit import BackendInfo, NativeDtypes, hookimpl, load_backend


@hookimpl
def mixprec_register_backends() -> Sequence[BackendInfo]:
    """The PyTorch backend."""
    return [
        BackendInfo(
            name="torch",
            framework="torch",
            api_module="mixprec_torch",
            extra="torch",
            description=(
                "PyTorch: wrap(model, optimizer, policy) with autocast-based O1, O2 masters, "
                "O3, DDP and FSDP2"
            ),
        )
    ]


@hookimpl
def mixprec_presets() -> Mapping[str, Any]:
    """``torch-autocast``, ``torch-autocast-cpu`` and ``torch-autocast-cuda``: torch.autocast's
    own op lists with GradScaler's default loss scale (see :mod:`mixprec_torch.presets`)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        from mixprec.errors import BackendNotAvailable

        raise BackendNotAvailable(
            "the torch-autocast presets need PyTorch: pip install 'mixprec[torch]'"
        ) from None
    from .presets import torch_autocast_presets

    return torch_autocast_presets()


@hookimpl
def mixprec_native_dtypes(backend: str, device: str, compute: str) -> NativeDtypes | None:
    """What ``torch.autocast`` does with each op, for the precision lockfile (see
    :mod:`mixprec_torch.o1.framework_autocast`; CUDA is probed on fake tensors)."""
    if backend != "torch":
        return None
    answer: NativeDtypes = load_backend("torch").native_dtypes(device, compute)
    return answer
