"""The Trainer's construction walks the net's block tree once: every pass after the walk (the
refusals, the snapshot of a failed construction, the parameters' dtypes, the casts,
BatchNorm's statistics, the compensated strategies' random stream) reads it, and the only
other traversal is Gluon's own ``net.collect_params()``, the parameters the Trainer trains.
Before, construction walked the tree up to 12 times (``blocks_of`` seven times,
``collect_params`` three, ``Block.apply`` and ``_collect_params_with_prefix`` once each).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

mx = pytest.importorskip("mxnet")

from _mx_nets import cnn  # noqa: E402
from mxnet import gluon  # noqa: E402

import mixprec.mxnet as mpx  # noqa: E402
from mixprec_mxnet import blocks  # noqa: E402

pytestmark = pytest.mark.mxnet


def _count_walks(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Count each traversal of a block tree from its root (recursive calls count once)."""
    counts: Counter[str] = Counter()
    depth: Counter[str] = Counter()

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth[name] += 1
            try:
                if depth[name] == 1:
                    counts[name] += 1
                return fn(*args, **kwargs)
            finally:
                depth[name] -= 1

        return wrapper

    for name in ("collect_params", "apply", "_collect_params_with_prefix"):
        monkeypatch.setattr(gluon.Block, name, counted(name, getattr(gluon.Block, name)))
    real_blocks_of, real_walk = blocks.blocks_of, blocks.walk

    def blocks_of(net: Any, path: str = "") -> Any:
        if not path:
            counts["blocks_of"] += 1
        return real_blocks_of(net, path)

    walk = counted("walk", real_walk)
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("mixprec_mxnet"):
            if getattr(module, "blocks_of", None) is real_blocks_of:
                monkeypatch.setattr(module, "blocks_of", blocks_of)
            if getattr(module, "walk", None) is real_walk:
                monkeypatch.setattr(module, "walk", walk)
    return counts


@pytest.mark.parametrize("policy", ["O2-bf16", "O1-bf16", "O3-bf16-kahan", "O0"])
def test_construction_walks_the_block_tree_once(
    monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    net = cnn()
    mpx.Trainer(net, "sgd", {"learning_rate": 0.1}, policy=policy)  # imports every wing
    net = cnn()
    counts = _count_walks(monkeypatch)
    mpx.Trainer(net, "sgd", {"learning_rate": 0.1}, policy=policy)
    assert dict(counts) == {"walk": 1, "collect_params": 1}
