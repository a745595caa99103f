"""RepeatedSkipWarning points at the user's line, on the NumPy plugin's backend (issue 37).

It pointed at mixprec's own lines (``stacklevel=4`` counted from the watch reached the
plugin's ``stepping.py``) and, with no parameter named, blamed "another rank" in a run of
one process. The PyTorch, apex and Gluon checks are in ``tests/torch`` and ``tests/mxnet``.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable

import numpy as np
import pytest

pytest.importorskip("mixprec_numpy")

from mixprec import StepGuard
from mixprec.kit import RepeatedSkipWarning
from mixprec_numpy import MLP, SGD, Trainer

X = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
Y = np.array([0, 1, 2, 0, 1, 2, 0, 1])


def marked_line(function: Callable[..., object], mark: str) -> int:
    """The line number of the line of ``function`` that holds ``mark``."""
    lines, start = inspect.getsourcelines(function)
    return start + next(i for i, text in enumerate(lines) if mark in text)


@pytest.mark.parametrize("preset", ["O0", "O1", "O2-bf16"])
def test_the_numpy_trainers_skip_warning_points_at_the_users_step(preset: str) -> None:
    model = MLP([4, 5, 3])
    trainer = Trainer(model, SGD(lr=0.1), policy=preset, guard=StepGuard(warn_after=3))
    x = X.copy()
    x[1, 0] = math.nan
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with np.errstate(all="ignore"):
                model.loss(x, Y)
                trainer.backward()
            trainer.step()  # the user's step
    (warned,) = [w for w in caught if issubclass(w.category, RepeatedSkipWarning)]
    line = marked_line(test_the_numpy_trainers_skip_warning_points_at_the_users_step, "# the user")
    assert (warned.filename, warned.lineno) == (__file__, line)
    assert "rank" not in str(warned.message)
