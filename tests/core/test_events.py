"""EventLog: the in-memory record users print, plot and subscribe to."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from mixprec.errors import MixprecError
from mixprec.events import EventLog, ScaleEvent, StepEvent


def sample_log() -> EventLog:
    log = EventLog()
    log.record(3, ScaleEvent("skip", 1024.0, 512.0))
    log.record(3, ScaleEvent("backoff", 1024.0, 512.0))
    log.record(9, ScaleEvent("growth", 512.0, 1024.0))
    log.record(12, ScaleEvent("skip", 1024.0, 1024.0))
    return log


def test_events_are_frozen_and_stamped():
    event = ScaleEvent("growth", 1.0, 2.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.kind = "skip"  # type: ignore[misc]
    stamped = StepEvent(5, event)
    assert (stamped.step, stamped.kind, stamped.scale_before, stamped.scale_after) == (
        5,
        "growth",
        1.0,
        2.0,
    )


def test_counts_and_events():
    log = sample_log()
    assert [e.step for e in log.events] == [3, 3, 9, 12]
    assert log.counts() == {"skip": 2, "backoff": 1, "growth": 1, "floor": 0}
    assert len(log) == 4


def test_bounded_but_counts_everything():
    log = EventLog(maxlen=3)
    for step in range(10):
        log.record(step, ScaleEvent("skip", 1.0, 1.0))
    assert [e.step for e in log] == [7, 8, 9]
    assert log.counts()["skip"] == 10
    assert EventLog().maxlen == 10_000


def test_scales_are_step_plot_points():
    assert sample_log().scales() == [(3, 1024.0), (4, 512.0), (10, 1024.0)]
    assert EventLog().scales() == []


def test_subscribers_get_events_as_they_happen():
    log = EventLog()
    seen: list[StepEvent] = []
    unsubscribe = log.subscribe(seen.append)
    log.record(1, ScaleEvent("skip", 2.0, 2.0))
    assert seen == [StepEvent(1, ScaleEvent("skip", 2.0, 2.0))]
    unsubscribe()
    log.record(2, ScaleEvent("skip", 2.0, 2.0))
    assert len(seen) == 1


def test_printable_table():
    text = str(sample_log())
    lines = text.splitlines()
    assert lines[0].split() == ["step", "event", "scale", "before", "scale", "after"]
    assert lines[2].split() == ["3", "skip", "1024", "512"]
    assert lines[-1] == "totals: skip=2, backoff=1, growth=1, floor=0"
    assert sample_log().format(last=1).splitlines()[2].split()[0] == "12"
    assert "no loss-scale events" in str(EventLog())


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(MixprecError, match=r"pip install 'mixprec\[docs\]'"):
        sample_log().plot(tmp_path / "scale.png")


def test_plot_writes_a_file(tmp_path):
    pytest.importorskip("matplotlib")
    path = sample_log().plot(tmp_path / "scale.png")
    assert (tmp_path / "scale.png").stat().st_size > 0
    assert path.endswith("scale.png")
