"""``wrap`` then ``torch.compile``: no graph breaks, no recompiles, the eager numbers.

For every preset and three ordinary models (an MLP with BatchNorm, LayerNorm and softmax, a
``nn.TransformerEncoderLayer``, a small residual CNN), a wrapped model compiled with
``torch.compile`` trains several steps with zero graph breaks and without recompiling
(``torch._dynamo.config.error_on_recompile``), and its losses and weights follow the same
wrapped model run eagerly. The tests compile with the ``aot_eager`` backend (dynamo and
AOTAutograd, which is where breaks and recompiles come from; inductor's code generation
adds minutes and no break); the default run covers O1-bf16 on every model and O2-bf16 on
two, every other preset and inductor itself run under the ``slow`` marker.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch._dynamo as dynamo  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import mixprec  # noqa: E402
import mixprec.torch as mpt  # noqa: E402

# dynamo probes `hasattr(tensor, "grad")` on a hook's non-leaf output and hides the warning
# that raises with its own filter, which pytest's "error" filter overrides; importing inductor
# imports torch.utils.mkldnn, which uses the deprecated torch.jit.script_method
pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning"
    ),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    # dynamo itself instantiates torch.autograd.Function() to trace any custom Function (the
    # FP8 layers'), and torch 2.13 warns about that instantiation
    pytest.mark.filterwarnings(
        "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
        ":DeprecationWarning"
    ),
]

# ------------------------------------------------------------------------------- the models


class Residual(nn.Module):
    """conv-bn-relu-conv-bn plus the input, as in a ResNet basic block."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(out)))


class Encoder(nn.Module):
    """One ``nn.TransformerEncoderLayer`` and a classification head (a user-defined root)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x).mean(dim=1))


def make_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(16, 32),
        nn.BatchNorm1d(32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.LayerNorm(32),
        nn.Linear(32, 5),
        nn.Softmax(dim=-1),
    )


def make_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        Residual(8),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 5),
    )


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp": (make_mlp, (8, 16)),
    "transformer": (Encoder, (4, 6, 16)),
    "cnn": (make_cnn, (4, 3, 8, 8)),
}

#: every preset, aliases aside (they name the same policies); "auto" resolves per machine
PRESETS = [
    "O0",
    "O1",
    "O2",
    "O3",
    "O1-bf16",
    "O2-bf16",
    "O3-bf16",
    "O3-bf16-kahan",
    "O3-bf16-sr",
    "O1-fp8",
    "O2-fp8",
    "torch-autocast",
    "torch-autocast-cpu",
]
#: the default run (about a minute here); every other pair runs under the slow marker
FAST = [(name, "O1-bf16") for name in MODELS] + [("mlp", "O2-bf16"), ("transformer", "O2-bf16")]
# FP8 layers carry their own autograd.Function; delayed scaling also writes its amaxes
# in the forward and the backward (the other recipes, and O1-fp8 on every model, are slow)
FAST += [("mlp", "O2-fp8,fp8=delayed")]
SLOW = [(name, preset) for preset in PRESETS for name in MODELS if (name, preset) not in FAST]
SLOW += [("mlp", "O1-fp8,fp8=rowwise"), ("mlp", "O1-fp8,fp8=mxfp8")]


def test_the_preset_list_is_complete() -> None:
    aliases = {"auto", "32", "16-mixed", "bf16-mixed", "16-true", "bf16-true"}
    cuda_only = {"torch-autocast-cuda"}
    assert set(mixprec.preset_names()) - aliases - cuda_only == set(PRESETS)


# ------------------------------------------------------------------------------- the runs


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    dynamo.reset()
    counters.clear()
    yield
    dynamo.reset()


def _batch(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    shape = MODELS[name][1]
    return torch.randn(*shape, generator=gen), torch.randint(0, 5, (shape[0],), generator=gen)


def _wrapped(name: str, preset: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = MODELS[name][0]()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # O3's and fp16's notes on this CPU
        return mpt.wrap(model, optimizer, policy=preset)


def _step(model: Any, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x).float(), y)
    with mpt.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    return float(loss.detach())


def _graph_breaks() -> dict[str, int]:
    return {reason.splitlines()[0]: n for reason, n in counters["graph_break"].items()}


def _check(name: str, preset: str, backend: str, steps: int = 3) -> None:
    """Train eager and compiled copies side by side: no break, no recompile, same numbers."""
    eager, eager_opt = _wrapped(name, preset)
    model, optimizer = _wrapped(name, preset)
    compiled = torch.compile(model, backend=backend)
    losses: list[tuple[float, float]] = []
    with dynamo.config.patch(error_on_recompile=True):
        for step in range(steps):  # the same shape each step: one compile
            x, y = _batch(name, step)
            losses.append((_step(eager, eager_opt, x, y), _step(compiled, optimizer, x, y)))
    assert _graph_breaks() == {}, f"{preset} {name}: graph breaks {_graph_breaks()}"
    tol = 1e-4 if preset in ("O0",) else 2e-2
    for step, (want, got) in enumerate(losses):
        assert got == pytest.approx(want, rel=tol, abs=tol), f"{preset} {name} step {step}"
    for (key, a), b in zip(eager.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.allclose(a.float(), b.float(), rtol=tol, atol=tol), f"{preset} {key}"
    # one frame, one graph: the boundary is the model's forward, not hooks compiled apart
    frames = counters["stats"]["unique_graphs"]
    assert frames == 1, f"{preset} {name}: {frames} graphs"
    # eval and back: the modes plain torch.compile recompiles for, and nothing more
    x, _ = _batch(name, 0)
    compiled.eval()
    with torch.no_grad():
        want = eager.eval()(x)
        got = compiled(x)
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
    compiled.train()
    _step(compiled, optimizer, *_batch(name, steps))
    assert _graph_breaks() == {}
    assert counters["stats"]["unique_graphs"] <= 2 * frames


@pytest.mark.parametrize(("name", "preset"), FAST)
def test_compiles_without_breaks_or_recompiles(name: str, preset: str) -> None:
    _check(name, preset, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize(("name", "preset"), SLOW)
def test_every_preset_compiles_without_breaks_or_recompiles(name: str, preset: str) -> None:
    _check(name, preset, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["O1-bf16", "O2-bf16", "torch-autocast-cpu"])
def test_inductor_compiles_the_transformer_without_breaks(preset: str) -> None:
    _check("transformer", preset, "inductor")


def test_o1_compiled_forward_runs_the_policy_dtypes() -> None:
    """The region reaches the compiled forward: matmuls in bfloat16, softmax in float32."""
    seen: dict[str, torch.dtype] = {}

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            p = torch.softmax(h, dim=-1)
            seen["linear"], seen["softmax"] = h.dtype, p.dtype
            return p

    model = mpt.wrap(Probe(), policy="O1-bf16")
    out = torch.compile(model, backend="aot_eager")(torch.randn(2, 8))
    assert seen == {"linear": torch.bfloat16, "softmax": torch.float32}
    assert out.dtype == torch.float32


def test_module_rules_compile_and_follow_the_policy() -> None:
    """Op rules inside a module rule, and a module pinned to float32 (an island), compile
    and train as they run eagerly."""
    policy = (
        mixprec.get_policy("O1-bf16")
        .with_module("layer", match="path", ops={"softmax": "lowp"})
        .with_module("head", "float32", match="path")
    )
    eager, eager_opt = _wrapped_with("transformer", policy)
    model, optimizer = _wrapped_with("transformer", policy)
    compiled = torch.compile(model, backend="aot_eager")
    with dynamo.config.patch(error_on_recompile=True):
        for step in range(2):
            x, y = _batch("transformer", step)
            assert _step(compiled, optimizer, x, y) == pytest.approx(
                _step(eager, eager_opt, x, y), rel=1e-2
            )
    assert _graph_breaks() == {}


def _wrapped_with(name: str, policy: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = MODELS[name][0]()
    return mpt.wrap(model, torch.optim.SGD(model.parameters(), lr=0.05), policy=policy)


def test_a_submodule_compiled_on_its_own_runs_under_the_policy_without_a_break() -> None:
    """``torch.compile(model.layer)`` (not the wrapped root): its entry opens the model's
    boundary inside the compiled frame, and it casts as it does eagerly."""
    model = mpt.wrap(Encoder(), policy="O1-bf16")
    x = torch.randn(2, 3, 16)
    want = model.layer(x)
    got = torch.compile(model.layer, backend="aot_eager")(x)
    assert got.dtype == want.dtype == torch.float32
    assert torch.allclose(got, want, rtol=1e-2, atol=1e-2)
    assert _graph_breaks() == {}
    assert counters["stats"]["unique_graphs"] == 1


def test_the_traced_forward_keeps_the_signature_and_copies() -> None:
    import copy
    import inspect

    model = mpt.wrap(Encoder(), policy="O1-bf16")
    assert list(inspect.signature(model.forward).parameters) == ["x"]
    twin = copy.deepcopy(model)
    x = torch.randn(2, 3, 16)
    assert torch.equal(twin(x), model(x))
    assert twin.forward.forward.__self__ is twin


def test_wrap_prepares_every_decision_the_forward_needs() -> None:
    """Every module with a rule of its own (each BatchNorm here) has its answers from wrap,
    shared between modules matching the same rules; a forward adds none (a compiled forward
    reads a table that never changes, so it never recompiles for it)."""
    model = mpt.wrap(make_cnn(), policy="O1-bf16")
    decisions = model._mixprec.casting.casting.decisions
    tables = dict(decisions.tables)
    assert len(tables) == 4  # no context, and the three BatchNorms
    assert len({id(t) for t in tables.values()}) == 2  # the BatchNorms share one
    sizes = {id(t): len(t) for t in tables.values()}
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    assert decisions.tables == tables
    assert {id(t): len(t) for t in decisions.tables.values()} == sizes
