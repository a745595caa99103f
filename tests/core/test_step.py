"""StepTracker: each misuse of the training loop gets a message naming the fix."""

from __future__ import annotations

import pytest

from mixprec.errors import StepOrderError
from mixprec.numerics.stages import Stage, StepTracker


def full_step(tracker: StepTracker, *, backwards: int = 1, unscale: bool = False) -> None:
    for _ in range(backwards):
        tracker.on_backward()
    if unscale:
        tracker.on_unscale()
    tracker.on_step()
    tracker.on_update()


def test_normal_loop_with_and_without_unscale():
    tracker = StepTracker()
    tracker.on_backward()
    assert tracker.needs_unscale
    tracker.on_unscale()
    assert tracker.stage is Stage.UNSCALED and not tracker.needs_unscale
    tracker.on_step()
    assert tracker.stage is Stage.STEPPED
    tracker.on_update()
    assert tracker.stage is Stage.READY
    full_step(tracker)
    assert tracker.steps == 2


def test_gradient_accumulation_is_allowed():
    tracker = StepTracker()
    full_step(tracker, backwards=4, unscale=True)
    full_step(tracker, backwards=3)
    assert tracker.steps == 2 and tracker.backwards == 0


def test_double_unscale():
    tracker = StepTracker()
    tracker.on_backward()
    tracker.on_unscale()
    with pytest.raises(StepOrderError) as err:
        tracker.on_unscale()
    assert str(err.value) == (
        "unscale_() has already been called on this optimizer since the last step(); "
        "call it once per step, after the last backward and before clipping"
    )


def test_backward_after_unscale():
    tracker = StepTracker()
    tracker.on_backward()
    tracker.on_unscale()
    with pytest.raises(StepOrderError, match="backward pass ran after unscale_\\(\\)") as err:
        tracker.on_backward()
    assert "mix scaled and unscaled" in str(err.value)
    assert "after the last micro-batch" in str(err.value)


def test_step_without_any_scaled_backward():
    with pytest.raises(StepOrderError, match="before any scaled backward") as err:
        StepTracker().on_step()
    assert "wrap the loss in scale_loss(loss, optimizer)" in str(err.value)


def test_double_step_without_backward():
    tracker = StepTracker()
    full_step(tracker)
    with pytest.raises(StepOrderError, match="twice without a scaled backward") as err:
        tracker.on_step()
    assert "scale_loss(loss, optimizer)" in str(err.value)


def test_step_twice_before_the_update():
    tracker = StepTracker()
    tracker.on_backward()
    tracker.on_step()
    with pytest.raises(StepOrderError, match=r"already been called .* in this iteration"):
        tracker.on_step()


def test_unscale_without_backward_and_after_step():
    tracker = StepTracker()
    with pytest.raises(StepOrderError, match="no scaled backward pass ran") as err:
        tracker.on_unscale()
    assert "scale_loss(loss, optimizer)" in str(err.value)
    tracker.on_backward()
    tracker.on_step()
    with pytest.raises(StepOrderError, match="unscale_\\(\\) was called after step\\(\\)"):
        tracker.on_unscale()


def test_backward_after_step_before_the_shared_update():
    tracker = StepTracker()
    tracker.on_backward()
    tracker.on_step()
    with pytest.raises(StepOrderError, match="before the loss scale was updated"):
        tracker.on_backward()


def test_update_leaves_an_accumulating_optimizer_alone():
    tracker = StepTracker()
    tracker.on_backward()
    tracker.on_update()  # another optimizer of the group stepped
    assert tracker.stage is Stage.READY and tracker.backwards == 1 and tracker.steps == 0


def test_reset_after_an_error():
    tracker = StepTracker()
    tracker.on_backward()
    tracker.on_step()
    tracker.reset()
    assert tracker.stage is Stage.READY and tracker.backwards == 0
    full_step(tracker)


def test_cancel_backward_takes_back_an_announced_backward() -> None:
    tracker = StepTracker()
    tracker.on_backward()
    tracker.cancel_backward()
    with pytest.raises(StepOrderError, match="scale_loss"):
        tracker.on_step()
