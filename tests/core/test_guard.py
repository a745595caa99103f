"""The step guard's framework-free half: StepGuard options and the repeated-skip warning."""

from __future__ import annotations

import inspect
import warnings

import pytest

import mixprec
from mixprec import DynamicScale, LossScaler, NoScale, PolicyError, StepGuard
from mixprec.errors import LossScaleError
from mixprec.numerics.guard import NORM_LIMIT, RepeatedSkipWarning, SkipWatch


def test_norm_limit_is_where_the_squared_norm_leaves_float32() -> None:
    assert NORM_LIMIT**2 == pytest.approx(3.4028234663852886e38)
    assert 1.8e19 < NORM_LIMIT < 1.9e19


def test_guard_options_are_validated_with_the_fix() -> None:
    assert StepGuard().warn_after == 10
    assert StepGuard.coerce(None) == StepGuard()
    assert StepGuard.coerce({"warn_after": 3}) == StepGuard(warn_after=3)
    with pytest.raises(PolicyError, match="warn_after must be >= 0"):
        StepGuard(warn_after=-1)
    with pytest.raises(PolicyError, match="must be an integer"):
        StepGuard(warn_after=2.5)  # type: ignore[arg-type]
    with pytest.raises(PolicyError, match="unknown StepGuard option"):
        StepGuard.coerce({"warn_every": 3})
    with pytest.raises(PolicyError, match=r"guard must be a mixprec\.StepGuard"):
        StepGuard.coerce(3)  # type: ignore[arg-type]


def test_skips_in_a_row_warn_at_each_multiple_with_steps_and_params() -> None:
    watch = SkipWatch(StepGuard(warn_after=3))
    watch.observe(0, False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 7):
            watch.observe(step, True, ["fc.weight"] if step < 4 else ["head.bias"])
    assert [w.category for w in caught] == [RepeatedSkipWarning, RepeatedSkipWarning]
    first, second = (str(w.message) for w in caught)
    assert "skipped 3 steps in a row" in first and "steps 1-3" in first
    assert "fc.weight (steps 1-3)" in first
    assert "skipped 6 steps in a row" in second and "head.bias (steps 4-6)" in second
    assert watch.in_a_row == 6
    watch.observe(7, False)  # a good step ends the run
    assert watch.in_a_row == 0


def test_warn_after_zero_never_warns() -> None:
    watch = SkipWatch(StepGuard(warn_after=0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(50):
            watch.observe(step, True, ["w"])
    assert watch.in_a_row == 50


def test_scaler_warns_after_ten_skips_in_a_row_by_default() -> None:
    scaler = LossScaler(NoScale())
    for _ in range(9):
        scaler.update(True, ("w",))
    with pytest.warns(RepeatedSkipWarning, match=r"skipped 10 steps in a row.*steps 0-9.*w \("):
        scaler.update(True, ("w",))
    assert scaler.skipped_steps == 10


def test_a_floor_that_raises_stays_a_loss_scale_error() -> None:
    scaler = LossScaler(DynamicScale(init=1.0, min=1.0, on_floor="raise"), guard=StepGuard(1))
    with pytest.raises(LossScaleError):
        scaler.update(True, ("w",))
    assert scaler.steps == 0 and scaler.skipped_steps == 0


def test_guard_is_exported() -> None:
    assert mixprec.StepGuard is StepGuard
    assert issubclass(mixprec.RepeatedSkipWarning, mixprec.MixprecWarning)


# ---------------------------------------------------------------------- issue 21: mutants


def test_coerce_hands_a_guard_back_as_it_is() -> None:
    guard = StepGuard(warn_after=4)
    assert StepGuard.coerce(guard) is guard
    assert StepGuard.coerce(None).warn_after == 10
    assert StepGuard.coerce({}) == StepGuard()


@pytest.mark.parametrize("value", [True, False, None, "3", 1.0])
def test_warn_after_takes_only_an_integer(value: object) -> None:
    with pytest.raises(PolicyError, match="must be an integer"):
        StepGuard(warn_after=value)  # type: ignore[arg-type]


def test_warn_after_zero_and_index_types_are_accepted() -> None:
    class Three:  # an integer type of another library (numpy.int64 and friends)
        def __index__(self) -> int:
            return 3

    assert StepGuard(warn_after=0).warn_after == 0
    converted = StepGuard(warn_after=Three()).warn_after  # type: ignore[arg-type]
    assert converted == 3 and type(converted) is int


def test_a_default_watch_warns_after_ten_and_its_run_lists_steps_and_names() -> None:
    watch = SkipWatch()
    assert watch.guard == StepGuard()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(9):
            watch.observe(step, True, ["a"])
    assert watch.run[-1] == (8, ("a",))
    with pytest.warns(RepeatedSkipWarning):
        watch.observe(9, True)


def test_the_message_spans_steps_and_ranks_parameters_by_how_often_they_overflowed() -> None:
    watch = SkipWatch(StepGuard(warn_after=0))
    for step, names in [(2, ["b"]), (3, ["a", "b"]), (5, ["b"]), (6, ["c"]), (7, ["c"])]:
        watch.observe(step, True, names)
    text = watch.message("loss scale 8")
    assert "skipped 5 steps in a row under loss scale 8 (the latest: steps 2-3, 5-7)" in text
    assert "Overflowing parameters: b (steps 2-3, 5); c (steps 6-7); a (steps 3)." in text
    assert f"(norm > {NORM_LIMIT:.3g})" in text


def test_the_message_names_eight_parameters_and_counts_the_rest() -> None:
    watch = SkipWatch(StepGuard(warn_after=2))
    watch.observe(0, True, [f"p{i}" for i in range(10)])
    with pytest.warns(RepeatedSkipWarning) as caught:
        watch.observe(1, True, ["p0"])
    text = str(caught[0].message)
    assert "p0 (steps 0-1); p1 (steps 0);" in text and "; and 2 more." in text
    assert "p9" not in text and "p8" not in text and "p7 (steps 0)" in text
    assert "under" not in text.split("(the latest")[0]


def test_the_message_of_a_skip_without_named_parameters_says_why() -> None:
    watch = SkipWatch(StepGuard(warn_after=1))
    with pytest.warns(RepeatedSkipWarning, match="another rank overflowed.*BatchNorm"):
        watch.observe(4, True, rank=3)
    assert "(the latest: steps 4)" in watch.message()
    assert "in a row on rank 3 " in watch.message(rank=3)
    assert "none in rank 3's gradients" in watch.message(rank=3)


def test_a_run_of_one_rank_blames_no_other_rank() -> None:
    """Issue 37: "another rank overflowed" in a single-process run."""
    watch = SkipWatch(StepGuard(warn_after=1))
    with pytest.warns(RepeatedSkipWarning) as caught:
        watch.observe(4, True)
    text = str(caught[0].message)
    assert "rank" not in text and "none named (a BatchNorm running statistic" in text
    with pytest.warns(RepeatedSkipWarning) as caught:
        watch.observe(5, True, ["fc.weight"])
    assert "rank" not in str(caught[0].message)
    with pytest.warns(RepeatedSkipWarning) as caught:
        watch.observe(6, True, ["fc.weight"], rank=0)
    assert "in a row on rank 0 (the latest" in str(caught[0].message)


def test_the_warning_points_at_the_users_line() -> None:
    """Issue 37: it pointed at mixprec's own lines (``stacklevel=4`` from the watch)."""
    scaler = LossScaler(NoScale(), guard=StepGuard(warn_after=3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            scaler.update(True)  # the user's line
    (warned,) = caught
    line = inspect.getsourcelines(test_the_warning_points_at_the_users_line)
    lineno = line[1] + next(i for i, t in enumerate(line[0]) if "# the user's line" in t)
    assert (warned.filename, warned.lineno) == (__file__, lineno)


def test_user_stacklevel_walks_out_of_every_mixprec_package() -> None:
    from mixprec.numerics.guard import _PASSED_THROUGH, MIXPREC_PACKAGES, user_stacklevel

    assert MIXPREC_PACKAGES == (
        "mixprec", "mixprec_torch", "mixprec_mxnet", "mixprec_numpy", "mixprec_jax",
    )  # fmt: skip
    source = "def call(inner):\n    return inner()\n"
    levels = {}
    assert frozenset(
        {"contextlib", "torch", "mxnet", "numpy", "jax", "jaxlib", "lightning",
         "lightning_fabric", "pytorch_lightning", "accelerate"}
    ) == _PASSED_THROUGH  # fmt: skip
    for package in (*MIXPREC_PACKAGES, *sorted(_PASSED_THROUGH), "my_training_code"):
        scope: dict[str, object] = {"__name__": f"{package}.module"}
        exec(compile(source, f"<{package}>", "exec"), scope)
        call = scope["call"]
        levels[package] = call(user_stacklevel)  # type: ignore[operator]
    # the helper's caller is the fake module's frame: 1 outside mixprec and the code a call
    # passes through (contextlib, the frameworks, the trainers), 2 (its caller) inside
    assert levels == {**dict.fromkeys(levels, 2), "my_training_code": 1}


def test_the_warning_repeats_at_each_multiple_and_only_the_latest_run_is_listed() -> None:
    watch = SkipWatch(StepGuard(warn_after=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(5):
            watch.observe(step, True, [f"w{step}"])
    assert len(caught) == 2
    assert "steps 2-3" in str(caught[1].message) and "w1" not in str(caught[1].message)


def test_parameters_overflowing_equally_often_are_listed_by_name() -> None:
    watch = SkipWatch(StepGuard(warn_after=0))
    watch.observe(1, True, ["z"])
    watch.observe(2, True, ["a"])
    assert "Overflowing parameters: a (steps 2); z (steps 1)." in watch.message()


def test_a_message_without_a_policy_says_nothing_of_one() -> None:
    watch = SkipWatch(StepGuard(warn_after=0))
    watch.observe(3, True, ["w"])
    assert watch.message().startswith("mixprec skipped 1 steps in a row (the latest: steps 3)")


def test_the_warning_points_at_the_code_that_called_the_backends_step() -> None:
    """A backend's step calls LossScaler.update; the warning names the user's line."""
    scaler = LossScaler(NoScale(), guard=StepGuard(warn_after=1))

    def backend_step() -> None:
        scaler.update(True, ("w",))

    with pytest.warns(RepeatedSkipWarning) as caught:
        backend_step()
    assert caught[0].filename == __file__


def test_a_guard_is_an_immutable_value() -> None:
    guard = StepGuard(warn_after=3)
    with pytest.raises(AttributeError):
        guard.warn_after = 4  # type: ignore[misc]
    assert hash(guard) == hash(StepGuard(warn_after=3))
