"""A Gluon net's blocks as module rules and the Trainer's construction read them.

:func:`blocks_of` lists a net's blocks, parents first, with the qualified path module rules
match (``"0.1"``), their class names and their name prefix. :func:`walk` is the Trainer's
construction plan: it walks the block tree once and keeps everything the later passes read
(the blocks in both orders, each block's children, the parameters in the net's order), so
the refusals, the snapshot for a failed construction, the parameters' dtypes, the casts,
BatchNorm's statistics and the compensated strategies' random stream all read one
:class:`BlockTree` instead of each walking the net again (it used to be walked 12 times).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mxnet import gluon

from .gluon_private import children, registered_params

__all__ = ["BlockInfo", "BlockTree", "blocks_of", "class_names", "walk"]


@dataclass(frozen=True)
class BlockInfo:
    """A block of the net as module rules see it: qualified path, class names, name prefix."""

    path: str
    classes: tuple[str, ...]
    prefix: str
    block: Any


def class_names(block: Any) -> tuple[str, ...]:
    """The block's class name and its base classes' (so ``*BatchNorm*`` catches subclasses)."""
    return tuple(cls.__name__ for cls in type(block).__mro__ if cls is not object)


def blocks_of(net: Any, path: str = "") -> Iterator[BlockInfo]:
    """Every block of ``net``, parents first; child paths join names with dots (``"0.1"``)."""
    yield BlockInfo(path, class_names(net), net.prefix, net)
    for name, child in children(net).items():
        yield from blocks_of(child, f"{path}.{name}" if path else name)


@dataclass(frozen=True)
class BlockTree:
    """One walk of a net's block tree (:func:`walk`). A block registered twice appears twice,
    as in Gluon's own walks."""

    blocks: tuple[BlockInfo, ...]
    """Every block, parents first (:func:`blocks_of`'s order)."""
    children: tuple[tuple[int, ...], ...]
    """Each block's children, as indices into :attr:`blocks`, in registration order."""
    ends: tuple[int, ...]
    """Block ``i``'s subtree is ``blocks[i:ends[i]]``."""
    post_order: tuple[Any, ...]
    """Every block, children first (``Block.apply``'s order)."""
    structural: tuple[gluon.Parameter, ...]
    """The parameters in the net's own order, as ``save_parameters`` lists them."""

    def subtree(self, index: int) -> list[BlockInfo]:
        """Block ``index`` and its descendants with paths relative to it, as
        ``blocks_of(block)`` gives them."""
        root = self.blocks[index].path
        cut = len(root) + 1 if root else 0
        return [
            BlockInfo(info.path[cut:] if i != index else "", info.classes, info.prefix, info.block)
            for i, info in enumerate(self.blocks[index : self.ends[index]], start=index)
        ]


def walk(net: gluon.Block) -> BlockTree:
    """Walk ``net``'s block tree once and keep what the Trainer's construction reads."""
    blocks: list[BlockInfo] = []
    kids: list[tuple[int, ...]] = []
    ends: list[int] = []
    post: list[Any] = []

    def visit(block: Any, path: str) -> dict[str, gluon.Parameter]:
        index = len(blocks)
        blocks.append(BlockInfo(path, class_names(block), block.prefix, block))
        kids.append(())
        ends.append(0)
        prefix = f"{path}." if path else ""
        # keyed as Block._collect_params_with_prefix keys them: the order is the net's
        named = {prefix + key: param for key, param in registered_params(block).items()}
        mine = []
        for name, child in children(block).items():
            mine.append(len(blocks))
            named.update(visit(child, f"{path}.{name}" if path else name))
        kids[index] = tuple(mine)
        ends[index] = len(blocks)
        post.append(block)
        return named

    structural = visit(net, "")
    return BlockTree(
        tuple(blocks), tuple(kids), tuple(ends), tuple(post), tuple(structural.values())
    )
