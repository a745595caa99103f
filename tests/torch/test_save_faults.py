"""``mixprec.torch.save`` is atomic, and a malformed mixprec entry is refused before any change."""

from __future__ import annotations

import copy
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from _torch_nets import mlp, same, snapshot, train_step  # noqa: E402
from torch import nn  # noqa: E402

import mixprec.torch as mpt  # noqa: E402
from mixprec.errors import CheckpointError  # noqa: E402
from mixprec.testing.faults import file_size_limit, kill_while_saving, leftovers  # noqa: E402

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX faults"),
]


def _trained(steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = mpt.wrap(model, opt, policy="O2-bf16", loss_scale="dynamic(init=1024)")
    for s in range(steps):
        train_step(model, opt, s, inject_inf=s == 1)
    return model, opt


def test_a_save_failing_half_way_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    model, opt = _trained()
    path = tmp_path / "ckpt.pt"
    mpt.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    before = path.read_bytes()
    train_step(model, opt, 5)
    with file_size_limit(len(before) // 2), pytest.raises((OSError, RuntimeError)):
        mpt.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    assert path.read_bytes() == before
    assert leftovers(tmp_path, "ckpt.pt") == []
    torch.load(path, weights_only=True)


@pytest.mark.slow
def test_a_kill_during_the_save_leaves_a_loadable_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "big.pt"
    script = textwrap.dedent(f"""
        import torch
        import mixprec.torch as mpt
        state = {{"w": torch.randn(2500, 2500)}}
        mpt.save(state, {str(path)!r})
        print("ready", flush=True)
        while True:
            mpt.save(state, {str(path)!r})
    """)
    for delay in (0.1, 0.27, 0.5):
        kill_while_saving(script, delay)
        assert torch.load(path, weights_only=True)["w"].shape == (2500, 2500)


def test_save_to_a_file_object_is_torch_save(tmp_path: Path) -> None:
    with open(tmp_path / "f.pt", "wb") as f:
        mpt.save({"x": torch.ones(2)}, f)
    assert torch.equal(torch.load(tmp_path / "f.pt", weights_only=True)["x"], torch.ones(2))


def _malformed(entry: dict[str, Any], what: str) -> Any:
    if what == "not a dict":
        return [entry]
    if what == "no scaler":
        return {k: v for k, v in entry.items() if k != "scaler"}
    if what == "bad counter":
        return dict(entry, scaler=dict(entry["scaler"], skipped_steps="two"))
    if what == "bad loss scale":
        return dict(entry, scaler=dict(entry["scaler"], loss_scale=[1.0]))
    if what == "bad tracker":
        return dict(entry, tracker={"steps": -3})
    return dict(entry, policy={"param": "float99"})


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("not a dict", "is a list, not a dict"),
        ("no scaler", "has no 'scaler'"),
        ("bad counter", "malformed"),
        ("bad loss scale", "'loss_scale' must be a dict"),
        ("bad tracker", "tracker"),
        ("bad policy", "malformed policy"),
    ],
)
def test_a_malformed_mixprec_entry_is_refused_before_any_change(what: str, message: str) -> None:
    _model, opt = _trained(4)
    sd = opt.state_dict()
    sd["mixprec"] = _malformed(sd["mixprec"], what)
    target, target_opt = _trained(2)
    before = snapshot(target, target_opt)
    scale, steps = mpt.state(target_opt).loss_scale, target_opt._mixprec.tracker.steps
    with pytest.raises(CheckpointError, match=message):
        target_opt.load_state_dict(sd)
    assert same(snapshot(target, target_opt), before)
    assert (mpt.state(target_opt).loss_scale, target_opt._mixprec.tracker.steps) == (scale, steps)


# ---------------------------------------------------------------------- issue 21


def _mismatched(sd: dict[str, Any], what: str) -> dict[str, Any]:
    """``sd`` with every value changed (so a partial load would show) and one mismatch."""
    out = {k: v + 1 if v.is_floating_point() else v for k, v in sd.items()}
    if what == "wrong shape":
        out["3.weight"] = torch.zeros(5, 5)
    elif what == "unknown key":
        out["9.weight"] = torch.zeros(5, 5)
    elif what == "missing key":
        del out["3.bias"]
    else:
        out["3.bias"] = [0.0] * 32
    return out


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("wrong shape", r"'3\.weight' has shape \[5, 5\], the model's \[32\]"),
        ("unknown key", r"unexpected '9\.weight'"),
        ("missing key", r"missing '3\.bias'"),
        ("no tensor", r"'3\.bias' is a list, not a tensor"),
    ],
)
def test_a_refused_model_load_changes_no_parameter_and_no_master(what: str, message: str) -> None:
    """PyTorch's loader raised its RuntimeError after '0.weight' and its master were
    overwritten; the whole state dict is now checked first."""
    model, opt = _trained(2)
    sd = _mismatched(model.state_dict(), what)
    before = snapshot(model, opt)
    with pytest.raises(CheckpointError, match=message):
        model.load_state_dict(sd)
    assert same(snapshot(model, opt), before)


def test_strict_false_still_loads_what_matches_and_refuses_a_wrong_shape() -> None:
    model, opt = _trained(2)
    sd = _mismatched(model.state_dict(), "missing key")
    result = model.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["3.bias"]
    assert torch.equal(model.state_dict()["0.weight"], sd["0.weight"])
    before = snapshot(model, opt)
    with pytest.raises(CheckpointError, match="has shape"):
        model.load_state_dict(_mismatched(model.state_dict(), "wrong shape"), strict=False)
    assert same(snapshot(model, opt), before)


def test_a_checkpoint_from_before_num_batches_tracked_still_loads() -> None:
    """BatchNorm fills in a missing num_batches_tracked of a checkpoint without version
    metadata; mixprec's check forgives what PyTorch's loader forgives."""
    model = mlp(batchnorm=True)
    model, _opt = mpt.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2-bf16")
    old = {k: v for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}
    model.load_state_dict(old)
    saved = model.state_dict()  # version 2 metadata: a missing one is a missing key
    del saved["1.num_batches_tracked"]
    with pytest.raises(CheckpointError, match=r"missing '1\.num_batches_tracked'"):
        model.load_state_dict(saved)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_an_optimizer_state_holding_nan_is_refused_before_it_reaches_the_weights(
    bad: float,
) -> None:
    model, opt = _trained(3)
    sd = copy.deepcopy(opt.state_dict())  # its inner dicts are the optimizer's own
    sd["state"][0]["exp_avg_sq"].view(-1)[0] = bad
    before = snapshot(model, opt)
    with pytest.raises(CheckpointError, match=r"inf or NaN \(parameter 0, 'exp_avg_sq'\)"):
        opt.load_state_dict(sd)
    assert same(snapshot(model, opt), before)
    train_step(model, opt, 7)  # the next clean step stays finite
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_save_through_a_symbolic_link_keeps_the_link(tmp_path: Path) -> None:
    (tmp_path / "run3").mkdir()
    (tmp_path / "latest.pt").symlink_to(Path("run3") / "ckpt.pt")
    mpt.save({"w": torch.ones(3)}, tmp_path / "latest.pt")
    assert (tmp_path / "latest.pt").is_symlink()
    assert torch.equal(
        torch.load(tmp_path / "run3" / "ckpt.pt", weights_only=True)["w"], torch.ones(3)
    )


@pytest.mark.parametrize("length", [242, 255])
def test_save_takes_every_name_torch_save_takes(tmp_path: Path, length: int) -> None:
    path = tmp_path / ("c" * (length - 3) + ".pt")
    torch.save({"w": torch.ones(1)}, path)  # torch accepts it
    mpt.save({"w": torch.zeros(1)}, path)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.zeros(1))


@pytest.mark.parametrize("policy", ["O2", "O2-bf16", "O3-bf16-kahan", "O3-bf16-sr,state=bfloat16"])
def test_every_checkpoint_mixprec_writes_loads_without_unpickling_code(
    policy: str, tmp_path: Path
) -> None:
    """docs/reliability.md's threat model: what mixprec puts into a checkpoint (the masters,
    the scaler, the tracker, the policy, the compensation and its generator state) is plain
    data, so ``torch.load(weights_only=True)`` (PyTorch's default) reads it and resumes."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = mpt.wrap(model, opt, policy=policy)
    for s in range(2):
        train_step(model, opt, s)
    path = tmp_path / "ckpt.pt"
    mpt.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    saved = torch.load(path, weights_only=True)
    fresh = mlp(1)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-3)
    fresh, fresh_opt = mpt.wrap(fresh, fresh_opt, policy=policy)
    fresh.load_state_dict(saved["model"])
    fresh_opt.load_state_dict(saved["optimizer"])
    assert same(snapshot(fresh), snapshot(model))
