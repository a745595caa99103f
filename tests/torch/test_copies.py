"""Inference wraps keep no float32 copy; deep copies keep exact masters; pickles and
optimizer copies refuse with the fix (issue 10 item 8, issue 11 item 5)."""

from __future__ import annotations

import copy
import gc
import io
import pickle

import pytest

torch = pytest.importorskip("torch")

from _torch_nets import batch, mlp, train_step  # noqa: E402
from torch import nn  # noqa: E402

import mixprec.torch as mpt  # noqa: E402
from mixprec.errors import CheckpointError  # noqa: E402

pytestmark = pytest.mark.torch


def trained(policy: str = "O2-bf16", steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = mlp(batchnorm=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = mpt.wrap(model, opt, policy=policy)
    for step in range(steps):
        train_step(model, opt, step)
    return model, opt


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage alive in the process (what a user's memory
    profile sees), counted once per storage."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        # type(), not isinstance: isinstance reads __class__, which some torch objects warn on
        if issubclass(type(obj), torch.Tensor) and not obj.is_meta:
            if type(obj).__module__.startswith("torch._subclasses"):
                continue  # FakeTensor & co. that torch.compile left behind: no real memory
            if obj.layout is not torch.strided:
                continue  # a sparse tensor another test left alive: it has no one storage
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def big_model() -> nn.Module:
    # 2.1M parameters (8.4 MB in float32): large enough that bookkeeping tensors are noise
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(1024, 1024), nn.LayerNorm(1024), nn.ReLU(), nn.Linear(1024, 1024)
    )


def test_inference_wrap_keeps_no_float32_copy() -> None:
    model = big_model()
    fp32_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    baseline = live_tensor_bytes() - fp32_bytes
    model = mpt.wrap(model, policy="O2-bf16")
    held = live_tensor_bytes() - baseline
    # bfloat16 weights only: half the float32 bytes (LayerNorm params included), not 1.5x
    assert held <= 0.52 * fp32_bytes, (held, fp32_bytes)
    assert not model._mixprec.group.masters.has_copies
    out = model(torch.randn(2, 1024))
    assert out.dtype == torch.float32
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_training_wrap_still_keeps_float32_masters() -> None:
    """The contrast: with an optimizer, the masters are there (1.5x), so the check above
    measures the inference path, not a measurement that cannot see masters."""
    model = big_model()
    fp32_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    baseline = live_tensor_bytes() - fp32_bytes
    model, opt = mpt.wrap(model, opt, policy="O2-bf16")
    held = live_tensor_bytes() - baseline
    assert held >= 1.45 * fp32_bytes, (held, fp32_bytes)


def test_inference_wrap_state_dict_holds_the_weights_it_computes_with() -> None:
    model = mpt.wrap(mlp(batchnorm=True), policy="O2-bf16")
    sd = model.state_dict()
    for name, p in model.named_parameters():
        assert sd[name].dtype == torch.float32
        assert torch.equal(sd[name], p.detach().float()), name
    # and a plain float32 model loads it
    plain = mlp(seed=1, batchnorm=True)
    plain.load_state_dict(sd)


@pytest.mark.parametrize("policy", ["O2-bf16", "O3-bf16", "O1-bf16"])
def test_deepcopy_keeps_exact_masters(policy: str) -> None:
    model, opt = trained(policy)
    best = copy.deepcopy(model)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    if policy == "O2-bf16":  # the masters are not the rounded weights: the check has teeth
        lin = model[0].weight
        assert not torch.equal(expected["0.weight"], lin.detach().float())
    saved = best.state_dict()
    assert saved.keys() == expected.keys()
    for key, value in expected.items():
        assert saved[key].dtype == value.dtype and torch.equal(saved[key], value), key
    # training on continues without touching the copy
    for step in range(3, 6):
        train_step(model, opt, step)
    assert not torch.equal(model.state_dict()["0.weight"], saved["0.weight"])
    for key, value in best.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_deepcopy_runs_under_the_policy_and_reloads() -> None:
    model, _ = trained("O2-bf16")
    best = copy.deepcopy(model)
    x, _ = batch(0)
    model.eval()
    best.eval()
    assert torch.equal(best(x), model(x))
    assert {p.dtype for p in best.parameters()} == {p.dtype for p in model.parameters()}
    # a fresh plain model restored from the copy's state dict equals the masters
    plain = mlp(seed=3, batchnorm=True)
    plain.load_state_dict(best.state_dict())
    masters = model.state_dict()
    for name, p in plain.named_parameters():
        assert torch.equal(p, masters[name]), name


def test_deepcopy_of_a_copy_that_changed_saves_its_own_values() -> None:
    model, _ = trained("O2-bf16")
    best = copy.deepcopy(model)
    with torch.no_grad():
        best[0].weight.mul_(0.5)
    assert torch.equal(best.state_dict()["0.weight"], best[0].weight.detach().float())


def test_deepcopy_keeps_float32_originals_of_cast_buffers() -> None:
    """O3 casts BatchNorm's running stats; an unchanged buffer saves its float32 original,
    in the copy too."""
    model = mlp(batchnorm=True)
    with torch.no_grad():
        model[1].running_mean.copy_(torch.linspace(0.1, 0.3, 32))
    expected = model[1].running_mean.clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mpt.wrap(model, opt, policy="O3-bf16")
    assert model[1].running_mean.dtype == torch.bfloat16
    best = copy.deepcopy(model)
    assert torch.equal(best.state_dict()["1.running_mean"], expected)


def test_pickling_a_wrapped_model_names_state_dict() -> None:
    model, _ = trained("O2-bf16")
    with pytest.raises(CheckpointError, match=r"model\.state_dict\(\)"):
        pickle.dumps(model)
    with pytest.raises(CheckpointError, match=r"model\.state_dict\(\)"):
        torch.save(model, io.BytesIO())
    # an inference wrap too
    inference = mpt.wrap(mlp(), policy="O1-bf16")
    with pytest.raises(CheckpointError, match="cannot be pickled"):
        pickle.dumps(inference)


def test_copying_or_pickling_a_wrapped_optimizer_names_its_state_dict() -> None:
    model, opt = trained("O2-bf16")
    before = [m.detach().clone() for m in mpt.master_params(opt)]
    for attempt in (copy.deepcopy, pickle.dumps, lambda o: torch.save(o, io.BytesIO())):
        with pytest.raises(CheckpointError, match=r"optimizer\.state_dict\(\)"):
            attempt(opt)
    # the refusal changed nothing, and the named fix works
    assert all(torch.equal(a, b) for a, b in zip(before, mpt.master_params(opt), strict=True))
    saved = copy.deepcopy(opt.state_dict())
    steps = mpt.state(opt).steps
    train_step(model, opt, 9)
    opt.load_state_dict(saved)
    assert mpt.state(opt).steps == steps


def test_the_plain_torch_objects_still_copy() -> None:
    """Only what wrap touched refuses: an unwrapped model and optimizer pickle as before."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pickle.loads(pickle.dumps(model))
    copy.deepcopy(opt)
