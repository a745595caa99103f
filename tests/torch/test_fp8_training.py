"""Training with FP8 layers: the delayed history, a bad batch, checkpoints, convergence, memory.

The delayed recipe's amax histories hold exactly the amaxes of the steps that were not
skipped; a batch with an inf never reaches a history or a scale (the step guard skips it);
a checkpoint resumes the histories and the weights bit for bit; every recipe trains a
teacher-student MLP about as well as bfloat16; the per-tensor recipes keep one byte per
input element for the backward where bfloat16 keeps two.
"""

from __future__ import annotations

import io
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from _fp8_tasks import fit, one_thread, start_and_end, teacher  # noqa: E402, F401
from _fp8_tasks import square_step as _step  # noqa: E402
from torch import nn  # noqa: E402

import mixprec.torch as mpt  # noqa: E402
from mixprec.errors import CheckpointError, MixprecWarning  # noqa: E402
from mixprec.numerics.fp8.recipes import FP8_RECIPES, tensor_scale  # noqa: E402


class Net(nn.Module):
    """Two Linears on the loss path and one (``aux``) whose output the loss ignores."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.aux = nn.Linear(8, 2)
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.aux(x))  # runs in FP8 too, but no gradient reaches it
        return self.fc2(torch.relu(self.fc1(x)))


def _wrapped(policy: str, seed: int = 0) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return mpt.wrap(model, optimizer, policy=policy)  # type: ignore[no-any-return]


def _layers(model: nn.Module) -> Any:
    return model._mixprec.group.fp8  # type: ignore[union-attr]


def _batches(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(32, 8, generator=gen) * (1 + i) for i in range(n)]


def test_the_delayed_history_holds_the_amaxes_of_the_steps() -> None:
    model, optimizer = _wrapped("O1-fp8,fp8=delayed(history=3)")
    seen: list[float] = []
    model.fc1.register_forward_pre_hook(lambda m, a: seen.append(float(a[0].abs().amax())))
    for x in _batches(4):
        _step(model, optimizer, x)
    state = _layers(model).state
    assert state.amax_history["fc1:input"] == tuple(reversed(seen))[:3]  # newest first
    weight = float(model.fc1.weight.detach().abs().amax())
    assert 0 < state.amax_history["fc1:weight"][0] != weight  # last step's, before the update
    assert len(state.amax_history["fc2:grad_output"]) == 3
    assert "aux:grad_output" not in state.amax_history  # no gradient ever reached it
    scales = _layers(model).forwards[0].delayed.scales.tolist()
    assert scales[0] == tensor_scale(max(seen[-3:]), "float8_e4m3fn")


def test_each_models_round_settles_only_its_own_layers_histories() -> None:
    """wrap([G, D], [opt_g, opt_d]): a GAN's D step (the round of opt_d alone) commits D's
    amaxes and leaves G's records, from the same forward, for G's own step; a bad batch in
    D's round never touches G's history."""
    torch.manual_seed(0)
    g, d = Net(), Net()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (g, d)]
    (g, d), (opt_g, opt_d) = mpt.wrap([g, d], opts, policy="O1-fp8,fp8=delayed(history=3)")
    x, y = _batches(2)
    _step(g, opt_g, x)
    _step(d, opt_d, x)
    history = _layers(g).state.amax_history
    before = dict(history)
    assert "model0.fc1:input" in before and "model1.fc1:input" in before
    g(y).float().sum().backward()  # G's forward and backward, its step comes later
    _step(d, opt_d, y * float("inf"))  # D's round: a bad batch, skipped
    history = _layers(g).state.amax_history
    assert history["model0.fc1:input"] == before["model0.fc1:input"]
    assert history["model1.fc1:input"] == before["model1.fc1:input"]
    opt_g.step()  # G's round commits G's records from its own forward
    history = _layers(g).state.amax_history
    assert history["model0.fc1:input"][0] == float(y.abs().amax())
    assert history["model1.fc1:input"] == before["model1.fc1:input"]


def test_a_bad_batch_never_enters_a_history_and_the_step_is_skipped() -> None:
    model, optimizer = _wrapped("O1-fp8,fp8=delayed")
    for x in _batches(2):
        _step(model, optimizer, x)
    layers = _layers(model)
    history = dict(layers.state.amax_history)
    scales = [f.delayed.scales.clone() for f in layers.forwards]
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    x = _batches(3)[2]
    x[0, 0] = float("inf")
    model.fc1.register_forward_pre_hook(lambda m, a: (a[0].nan_to_num(posinf=1.0),))
    _step(model, optimizer, x)  # the loss path is finite: only aux saw the inf
    assert mpt.state(optimizer).last_step_skipped
    assert layers.state.amax_history == history
    assert all(
        torch.equal(a, f.delayed.scales) for a, f in zip(scales, layers.forwards, strict=True)
    )
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    _step(model, optimizer, _batches(4)[3])  # the next good batch steps and records
    assert not mpt.state(optimizer).last_step_skipped
    assert layers.state.amax_history != history


def _save(model: nn.Module, optimizer: torch.optim.Optimizer) -> bytes:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    return buffer.getvalue()


def test_delayed_histories_resume_bit_for_bit() -> None:
    batches = _batches(9)
    original, opt = _wrapped("O2-fp8,fp8=delayed(history=4,margin=1)")
    for x in batches[:5]:
        _step(original, opt, x)
    blob = _save(original, opt)
    assert opt.state_dict()["mixprec"]["fp8"]["delayed"]["amax_history"]["fc1:input"]
    resumed, ropt = _wrapped("O2-fp8,fp8=delayed(history=4,margin=1)", seed=1)
    saved = torch.load(io.BytesIO(blob), weights_only=True)
    resumed.load_state_dict(saved["model"])
    ropt.load_state_dict(saved["optimizer"])
    assert _layers(resumed).state == _layers(original).state
    for x in batches[5:]:
        assert _step(original, opt, x) == _step(resumed, ropt, x)
    for (key, a), b in zip(
        original.state_dict().items(), resumed.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), key
    assert _layers(resumed).state == _layers(original).state


def test_a_foreign_fp8_state_is_refused_before_anything_loads() -> None:
    model, opt = _wrapped("O1-fp8,fp8=delayed")
    _step(model, opt, _batches(1)[0])
    other, other_opt = _wrapped("O1-fp8,fp8=delayed(history=8)")
    _step(other, other_opt, _batches(2)[1])
    before = _layers(other).state
    moments = [s["exp_avg"].clone() for s in other_opt.state.values()]
    with pytest.raises(CheckpointError, match="history"), pytest.warns(MixprecWarning):
        other_opt.load_state_dict(opt.state_dict())  # warns of the other policy, then refuses
    assert _layers(other).state == before
    assert all(
        torch.equal(m, s["exp_avg"]) for m, s in zip(moments, other_opt.state.values(), strict=True)
    )
    sd = opt.state_dict()
    sd["mixprec"]["fp8"] = {"recipe": "tensorwise"}
    with pytest.raises(CheckpointError, match="fp8=delayed"):
        opt.load_state_dict(sd)


# ------------------------------------------------------------------------------- training


def _teacher_student(policy: str, steps: int) -> tuple[float, float]:
    """The mean loss of the first 5 and of the last 10 of ``steps`` steps of a student MLP
    fitting a fixed teacher on fresh batches."""
    gen = torch.Generator().manual_seed(0)
    target = teacher()
    torch.manual_seed(1)
    student = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    optimizer = torch.optim.Adam(student.parameters(), lr=1e-2)
    student, optimizer = mpt.wrap(student, optimizer, policy=policy)
    losses: list[float] = []
    fit(student, optimizer, target, gen, steps, losses)
    return start_and_end(losses)


def test_every_recipe_trains_about_as_well_as_bfloat16() -> None:
    start, bf16 = _teacher_student("O1-bf16", steps=60)
    assert bf16 < start / 10  # the run learns
    for recipe in FP8_RECIPES:
        fp8 = _teacher_student(f"O1-fp8,fp8={recipe}", steps=60)[1]
        assert fp8 < bf16 * 1.25, f"{recipe}: {fp8} vs bfloat16 {bf16}"


def _saved_bytes(policy: str) -> int:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    mpt.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=policy)
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randn(512, 256)).float().sum().backward()
    return total


def test_per_tensor_recipes_save_fp8_for_the_backward() -> None:
    bf16 = _saved_bytes("O1-bf16")
    assert _saved_bytes("O1-fp8") < 0.55 * bf16
    assert _saved_bytes("O1-fp8,fp8=delayed") < 0.55 * bf16
    assert _saved_bytes("O1-fp8,fp8=rowwise") >= bf16  # keeps the input as it came
