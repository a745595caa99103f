"""RepeatedSkipWarning on PyTorch and the apex drop-in: it points at the user's line and
names the rank only in a run of several ranks (issue 37).

Found: the warning pointed at mixprec's own lines (``stepping.py``, ``apex_amp.py``) and,
where no parameter was named, blamed "another rank" in a single-process run. The ranks'
case runs as found: two gloo ranks, one of which overflows, and a group of one rank.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import mixprec.torch as mpt  # noqa: E402
from mixprec import StepGuard  # noqa: E402
from mixprec.compat import apex_amp as amp  # noqa: E402
from mixprec.kit import RepeatedSkipWarning  # noqa: E402

INF = float("inf")


def marked_line(function: Callable[..., object], mark: str) -> int:
    lines, start = inspect.getsourcelines(function)
    return start + next(i for i, text in enumerate(lines) if mark in text)


def _skip_warnings(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if issubclass(w.category, RepeatedSkipWarning)]


@pytest.mark.parametrize("policy", ["O1", "O2", "O1-bf16", "O0"])
def test_the_skip_warning_points_at_the_users_optimizer_step(policy: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = mpt.wrap(model, optimizer, policy=policy, guard=StepGuard(warn_after=3))
    x = torch.full((2, 4), INF)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            optimizer.zero_grad()
            loss = model(x).float().sum()
            with mpt.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()  # the user's step
    (warned,) = _skip_warnings(caught)
    line = marked_line(test_the_skip_warning_points_at_the_users_optimizer_step, "# the user")
    assert (warned.filename, warned.lineno) == (__file__, line)
    assert "rank" not in str(warned.message)


def test_the_apex_drop_ins_skip_warning_points_at_the_users_loop_and_blames_no_rank() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    x = torch.full((2, 4), INF)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(10):  # the default guard: warn after 10 skips in a row
            optimizer.zero_grad()
            loss = model(x).float().sum()
            with amp.scale_loss(loss, optimizer) as scaled:  # the user's loop
                scaled.backward()  # the user's loop
            optimizer.step()  # the user's loop
    # two: the loss's scaler (apex keeps one per loss) at the with statement, and the
    # optimizer's at its step; each at the user's line, neither blaming a rank
    warned = _skip_warnings(caught)
    assert len(warned) == 2
    lines, start = inspect.getsourcelines(
        test_the_apex_drop_ins_skip_warning_points_at_the_users_loop_and_blames_no_rank
    )
    for each in warned:
        assert each.filename == __file__, (each.filename, each.lineno)
        assert "# the user's loop" in lines[each.lineno - start]
        assert "rank" not in str(each.message)


_WORKER = textwrap.dedent("""
    import gc, json, sys, warnings
    import torch
    import torch.distributed as dist
    from torch import nn
    import mixprec.torch as mpt
    from mixprec import StepGuard

    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = mpt.wrap(model, optimizer, policy="O1", guard=StepGuard(warn_after=2))
    x = torch.full((2, 4), float("inf") if rank == world - 1 else 0.01)  # the last overflows
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            optimizer.zero_grad()
            with mpt.scale_loss(model(x).float().sum() * 1e-3, optimizer) as scaled:
                scaled.backward()
            optimizer.step()  # the user's step
    said = [
        {"text": str(w.message), "file": w.filename, "line": w.lineno}
        for w in caught if w.category.__name__ == "RepeatedSkipWarning"
    ]
    with open(out, "w") as f:
        json.dump(said, f)
    # torch 2.13's gloo can abort at shutdown ("terminate called without an active
    # exception") when one rank tears its group down while the other is still in a
    # collective, or when the group outlives destroy_process_group() in a cycle: meet, collect,
    # then destroy (the guide's shutting-down advice)
    del model, optimizer
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
""")


def _ranks(tmp_path: Path, world: int) -> list[list[dict[str, object]]]:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    children = []
    for rank in range(world):
        argv = [str(script), str(rank), str(world), str(tmp_path / "store")]
        argv.append(str(tmp_path / f"rank{rank}.json"))
        children.append(
            subprocess.Popen([sys.executable, *argv], env=env, stderr=subprocess.PIPE, text=True)
        )
    for child in children:
        _, err = child.communicate(timeout=240)
        assert child.returncode == 0, err[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_name_their_rank_and_the_one_that_did_not_overflow_says_another_did(
    tmp_path: Path,
) -> None:
    zero, one = _ranks(tmp_path, 2)
    line = _WORKER.splitlines().index(
        next(t for t in _WORKER.splitlines() if "# the user's step" in t)
    )
    for said in (zero, one):
        assert len(said) == 1 and said[0]["file"] == str(tmp_path / "worker.py")
        assert said[0]["line"] == line + 1
    assert " on rank 0 (the latest" in zero[0]["text"]  # type: ignore[operator]
    assert "none in rank 0's gradients (another rank overflowed" in zero[0]["text"]  # type: ignore[operator]
    assert " on rank 1 (the latest" in one[0]["text"]  # type: ignore[operator]
    assert "Overflowing parameters: " in one[0]["text"] and "another rank" not in one[0]["text"]  # type: ignore[operator]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_group_of_one_rank_names_no_rank(tmp_path: Path) -> None:
    (said,) = _ranks(tmp_path, 1)
    assert len(said) == 1 and "rank" not in said[0]["text"]  # type: ignore[operator]
