"""The memory benchmark's breakdown of the peak (``python -m benchmarks.memory``): the peak it
replays is the case's own, and what it lists as alive then is what was alive."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks.memory import _live_at_peak, _replay_peak  # noqa: E402

pytestmark = pytest.mark.torch

MIB = 2**20


def _made_here() -> None:
    kept = torch.ones(MIB // 4)  # 1 MiB, alive at the peak
    gone = torch.zeros(2 * MIB // 4)  # 2 MiB, freed before it
    del gone
    peak = torch.full((3 * MIB // 4,), 2.0)  # 3 MiB: the peak is 4 MiB
    del peak
    small = torch.ones(MIB // 8)  # after the peak
    del kept, small


def test_breakdown_lists_what_is_alive_at_the_replayed_peak() -> None:
    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        _made_here()
    peak, live = _live_at_peak(prof)
    assert peak == _replay_peak(prof) == 4 * MIB
    assert sorted(nbytes for nbytes, _ in live) == [MIB, 3 * MIB]
    labels = {nbytes: label for nbytes, label in live}
    assert labels[MIB].startswith("aten::ones(")
    assert labels[3 * MIB].startswith("aten::full(")
    assert "test_memory_peak_breakdown.py" in labels[MIB]  # the line that made it
