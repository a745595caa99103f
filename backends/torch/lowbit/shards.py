"""The low-bit state of a parameter FSDP2 shards: each rank quantizes its own shard.

Under FSDP2 a parameter is a ``DTensor`` whose rank-local part is a slice of rows
(``Shard(0)``; ``Replicate`` on the other mesh dimensions under HSDP), and torch's optimizer
keeps its moments as ``DTensor`` s of the same layout. A quantized moment is kept, between two
steps, as the codes and the blocks' absmax of this rank's shard only, so the state's memory
per rank falls with the shards like the parameter's:

- the shard (``to_local()``, flat) is encoded block by block from its first element, as an
  unsharded tensor of its size is (:mod:`.codec`): the same codes and absmax;
- these are padded with zero bytes and zero absmax to the length of a shard of
  ``ceil(rows / shards)`` rows (FSDP2's own padding, :attr:`Layout.padded` elements), so that
  every rank's part has the same length; decoding reads only the shard's own;
- the codes and the absmax are 1-D ``DTensor`` s over the parameter's mesh with its
  placements: ``shards * code_count(padded)`` codes and ``shards * blocks(padded)`` absmax in
  all, each rank holding its own even part. So ``optimizer.state_dict()`` holds them as torch
  holds the float32 moments, and ``torch.distributed.checkpoint`` saves each rank's part and
  loads it back into the same rank (the saved tag names the shard count: another world size
  is refused at load, see :mod:`.state`).

Decoding gives this rank's moment back as a ``DTensor`` of the parameter's shape and layout:
the values an unsharded run over the same shard would decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mixprec.kit import StateFormat

from .codec import blocks_of, code_count, dequantize, encode

__all__ = [
    "Layout",
    "decode",
    "dtensor_type",
    "encode_shard",
    "is_sharded",
    "layout_of",
    "local",
    "refusal",
]


def dtensor_type() -> type | None:
    """``torch.distributed.tensor.DTensor``, or None in a build without it."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - builds without distributed
        return None
    return DTensor


def is_sharded(tensor: object) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (a parameter or state tensor FSDP2 shards)."""
    dtensor = dtensor_type()
    return dtensor is not None and isinstance(tensor, dtensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a ``DTensor``, else ``tensor`` itself."""
    if is_sharded(tensor):
        return tensor.to_local()  # type: ignore[attr-defined, no-any-return]
    return tensor


@dataclass(frozen=True)
class Layout:
    """Where a sharded parameter's codes live (see the module)."""

    mesh: Any
    """The parameter's ``DeviceMesh``."""
    placements: tuple[Any, ...]
    """The parameter's: ``Shard(0)`` on one mesh dimension, ``Replicate`` on any other."""
    shard_dim: int
    """The mesh dimension that shards the rows."""
    shards: int
    """How many shards the rows are cut into."""
    padded: int
    """Elements of every rank's shard, padded as FSDP2 pads them."""

    def codes(self, fmt: StateFormat) -> int:
        """This rank's code bytes."""
        return code_count(fmt, self.padded)

    def blocks(self, fmt: StateFormat) -> int:
        """This rank's absmax values."""
        return blocks_of(fmt, self.padded)

    def group(self) -> Any:
        """The process group of the ranks that hold the other shards."""
        return self.mesh.get_group(self.shard_dim)


def refusal(param: torch.Tensor) -> str | None:
    """Why the sharded ``param``'s state cannot be quantized per shard (its placements are
    not rows on one mesh dimension), None where it can (or where it is no ``DTensor``)."""
    if not is_sharded(param):
        return None
    from torch.distributed.tensor import Replicate, Shard

    placements = tuple(param.placements)  # type: ignore[attr-defined]
    sharding = [p for p in placements if not isinstance(p, Replicate)]
    if len(sharding) == 1 and type(sharding[0]) is Shard and sharding[0].dim == 0:
        return None
    return f"placements {placements}"


def layout_of(param: torch.Tensor) -> Layout | None:
    """The layout of a sharded parameter's codes, None for any other tensor (or one whose
    placements :func:`refusal` names)."""
    if not is_sharded(param) or refusal(param) is not None:
        return None
    from torch.distributed.tensor import Replicate

    placements = tuple(param.placements)  # type: ignore[attr-defined]
    dim = next(i for i, p in enumerate(placements) if not isinstance(p, Replicate))
    shards = int(param.device_mesh.size(dim))  # type: ignore[attr-defined]
    rows = int(param.shape[0])
    per_row = param.numel() // rows if rows else 0
    padded = -(-rows // shards) * per_row
    return Layout(param.device_mesh, placements, dim, shards, padded)  # type: ignore[attr-defined]


def _spread(part: torch.Tensor, lay: Layout) -> torch.Tensor:
    """A rank's even part of a 1-D tensor (codes or absmax) as the ``DTensor`` of them all."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        part,
        lay.mesh,
        lay.placements,
        run_check=False,
        shape=torch.Size([lay.shards * part.numel()]),
        stride=(1,),
    )


def _padded(part: torch.Tensor, size: int) -> torch.Tensor:
    """``part`` (1-D) followed by zeros up to ``size`` elements."""
    if part.numel() >= size:
        return part
    return torch.cat([part, part.new_zeros(size - part.numel())])


def encode_shard(
    value: torch.Tensor, lay: Layout, fmt: StateFormat, signed: bool
) -> tuple[torch.Tensor, torch.Tensor, bool | torch.Tensor]:
    """:func:`~.codec.encode` of this rank's part of the moment ``value`` (a ``DTensor``),
    padded (see the module): the codes and absmax as ``DTensor`` s, and whether every
    absmax is finite."""
    flat = local(value).detach().float().reshape(-1).contiguous()
    codes, scale, ok = encode(flat, fmt, signed)
    codes = _padded(codes, lay.codes(fmt))
    scale = _padded(scale, lay.blocks(fmt))
    return _spread(codes, lay), _spread(scale, lay), ok


def decode(
    codes: torch.Tensor,
    scale: torch.Tensor,
    lay: Layout,
    fmt: StateFormat,
    signed: bool,
    param: torch.Tensor,
) -> torch.Tensor:
    """This rank's moment from its codes: float32, a ``DTensor`` of ``param``'s shape and
    layout."""
    from torch.distributed.tensor import DTensor

    mine = local(param)
    n = mine.numel()
    own_codes = local(codes)[: code_count(fmt, n)]
    own_scale = local(scale)[: blocks_of(fmt, n)].float()
    part = dequantize(own_codes, own_scale, fmt, signed, n).view(mine.shape)
    return DTensor.from_local(
        part,
        param.device_mesh,  # type: ignore[attr-defined]
        param.placements,  # type: ignore[attr-defined]
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )
