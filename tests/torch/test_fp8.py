"""FP8 layers under ``wrap``: the numbers, the layers it picks, the refusals.

The quantised operands equal the NumPy plugin's reference bit for bit; a wrapped
``nn.Linear``'s output and gradients equal an independent quantise -> dequantise -> matmul
computed with NumPy; ``torch._scaled_mm`` and the emulation give the same bits on this CPU;
module rules keep layers out of FP8; bad input is refused before anything changes.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _fp8_tasks import one_thread  # noqa: E402, F401
from torch import nn  # noqa: E402

import mixprec  # noqa: E402
import mixprec.torch as mpt  # noqa: E402
from mixprec.errors import PolicyError, WrapError  # noqa: E402
from mixprec.kit import BACKWARD_FORMAT, FORWARD_FORMAT, FP8_RECIPES  # noqa: E402
from mixprec_numpy import fp8 as reference  # noqa: E402
from mixprec_torch.fp8.linear import FP8Forward, FP8LinearFunction  # noqa: E402
from mixprec_torch.fp8.numerics import quantise  # noqa: E402


def _nasty(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Values over 20 decades, an outlier row and column, zeros, float32 subnormals."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-12, 8, cols)[torch.randperm(cols)]
    x[1] *= 1e4
    x[:, 3] = 0.0
    x[2, :5] = torch.tensor([1e-40, -3e-42, 1e-45, 2.0**-126, -0.0])
    return x


def _bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("recipe", FP8_RECIPES)
@pytest.mark.parametrize("fmt", [FORWARD_FORMAT, BACKWARD_FORMAT])
def test_quantised_operands_equal_the_numpy_reference(recipe: str, fmt: str) -> None:
    x = _nasty(24, 100)
    for dim in (0, 1):
        scales = (None, 0.0, 3.75) if recipe == "delayed" else (None,)
        for scale in scales:
            given = None if scale is None else torch.tensor(scale)
            got = quantise(x, fmt, recipe, dim, given)
            want = reference.quantise(x.numpy(), fmt, recipe, dim, scale or None)
            assert (_bits(got.q.float().numpy()) == _bits(want.q)).all(), (dim, scale)
            inverse = np.broadcast_to(got.inverse.numpy(), x.shape)
            assert (_bits(inverse) == _bits(np.broadcast_to(want.inverse, x.shape))).all()
    # the test can fail: a plain cast without the scale is a different tensor
    assert not torch.equal(
        quantise(x, fmt, recipe, 1).q.float(), x.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    )


def _reference_linear(
    x: np.ndarray, w: np.ndarray, b: np.ndarray, g: np.ndarray, recipe: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Output, input gradient and weight gradient from NumPy's quantise -> dequantise, the
    products in float64 (``w`` is torch's ``[out, in]``)."""

    def deq(a: np.ndarray, fmt: str, axis: int) -> np.ndarray:
        return reference.dequantise(reference.quantise(a, fmt, recipe, axis)).astype(np.float64)

    y = deq(x, FORWARD_FORMAT, 1) @ deq(w, FORWARD_FORMAT, 1).T + b
    grad_x = deq(g, BACKWARD_FORMAT, 1) @ deq(w, FORWARD_FORMAT, 0)
    grad_w = deq(g, BACKWARD_FORMAT, 0).T @ deq(x, FORWARD_FORMAT, 0)
    return y, grad_x, grad_w


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_linear_equals_an_independent_quantise_dequantise_reference(recipe: str) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(40, 24)
    plain = nn.Linear(40, 24)
    plain.load_state_dict(layer.state_dict())
    mpt.wrap(layer, policy=f"O1-fp8,fp8={recipe}")
    assert _fp8_layers(layer) == [""]
    x = torch.randn(3, 5, 40) * 4
    x[0, 0, 7] = 300.0  # an outlier: the recipes differ
    x.requires_grad_(True)
    y = layer(x)
    # the layer computes in bfloat16; the model's boundary hands out policy.output (float32)
    assert y.shape == (3, 5, 24) and torch.equal(y, y.bfloat16().float())
    g = torch.randn(3, 5, 24)
    y.backward(g.bfloat16().float())
    x2, g2 = x.detach().reshape(15, 40).numpy(), g.bfloat16().float().reshape(15, 24).numpy()
    w, b = layer.weight.detach().numpy(), layer.bias.detach().numpy()
    want_y, want_gx, want_gw = _reference_linear(x2, w, b, g2, recipe)
    # one rounding to bfloat16 of a float32 sum: within one bfloat16 step of the reference
    torch.testing.assert_close(
        y.float().reshape(15, 24), torch.from_numpy(want_y).float(), rtol=2**-7, atol=1e-5
    )
    assert x.grad is not None and layer.weight.grad is not None
    assert x.grad.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32  # O1
    torch.testing.assert_close(
        x.grad.reshape(15, 40), torch.from_numpy(want_gx).float(), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(
        layer.weight.grad, torch.from_numpy(want_gw).float(), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(layer.bias.grad, torch.from_numpy(g2.sum(0)), rtol=1e-6, atol=1e-6)
    # and FP8 happened: a bfloat16 linear gives other numbers
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = plain(x.detach())
    assert not torch.equal(bf16.float(), y.detach().float())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_scaled_mm_and_the_emulation_give_the_same_bits_on_this_cpu(recipe: str) -> None:
    torch.manual_seed(1)
    x = torch.randn(16, 32) * 3
    w = torch.randn(8, 32, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    results = []
    for native in (True, False):
        xi = x.clone().requires_grad_(True)
        wi = w.detach().clone().requires_grad_(True)
        bi = b.detach().clone().requires_grad_(True)
        y, _ = FP8LinearFunction.apply(xi, wi, bi, recipe, native, torch.bfloat16, None, None)
        y.float().square().sum().backward()
        results.append((y, xi.grad, wi.grad, bi.grad))
    for native_t, emulated_t in zip(*results, strict=True):
        assert torch.equal(native_t, emulated_t)


class LM(nn.Module):
    """Blocks of two Linears, then a head: the shape module rules talk about."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(2)
        )
        self.norm = nn.LayerNorm(16)
        self.lm_head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.lm_head(self.norm(x))


def _fp8_layers(model: nn.Module) -> list[str]:
    record = getattr(model, "_mixprec", None)
    layers = None if record is None else record.group.fp8
    if layers is None:
        return []
    assert all(isinstance(f, FP8Forward) for f in layers.forwards)
    return list(layers.names)


@pytest.mark.parametrize(
    ("spec", "kept"),
    [
        ("O1-fp8", []),
        ("O1-fp8,path:lm_head=bfloat16", ["lm_head"]),
        ("O2-fp8,path:blocks.0=float32", ["blocks.0.0", "blocks.0.2"]),
        ("O1-fp8,path:blocks.*.2=(fp32=linear)", ["blocks.0.2", "blocks.1.2"]),
        (
            "O1-fp8,fp32+=linear",
            ["blocks.0.0", "blocks.0.2", "blocks.1.0", "blocks.1.2", "lm_head"],
        ),
    ],
)
def test_module_rules_keep_layers_out_of_fp8(spec: str, kept: list[str]) -> None:
    model = LM()
    mpt.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=spec)
    every = ["blocks.0.0", "blocks.0.2", "blocks.1.0", "blocks.1.2", "lm_head"]
    assert _fp8_layers(model) == [n for n in every if n not in kept]
    model(torch.randn(4, 16)).float().sum().backward()  # and the model still trains


def test_explain_says_float8_and_the_recipe() -> None:
    policy = mixprec.get_policy("O1-fp8,fp8=delayed(history=32)")
    text = policy.explain("linear")
    assert "float8_e4m3fn" in text and "float8_e5m2" in text and "delayed" in text
    assert "history 32" in text
    ruled = policy.with_module("lm_head", "bfloat16", match="path")
    assert "no FP8" in ruled.explain("linear", module="lm_head")
    assert ruled.fp8_for("lm_head", "Linear") is None and ruled.fp8_for("x", "Linear") is not None


def test_functional_linear_outside_nn_linear_is_not_fp8() -> None:
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, 16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(x, self.weight)

    model = Functional()
    mpt.wrap(model, policy="O1-fp8")
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = nn.functional.linear(x, model.weight)
    assert torch.equal(model(x).float(), want.float())  # the base policy's bfloat16 GEMM


# ------------------------------------------------------------------------------- refusals


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    ("spec", "error", "words"),
    [
        ("O0,fp8=tensorwise", PolicyError, ["float32", "O1-fp8"]),
        ("O1-bf16,fp8=fp4", PolicyError, ["tensorwise, rowwise, delayed, mxfp8"]),
        ("O1-fp8,fp8=delayed(history=99999)", PolicyError, ["history", "1024"]),
        ("O1-fp8,fp8=rowwise(margin=1)", PolicyError, ["takes no settings"]),
    ],
)
def test_bad_fp8_items_are_refused_before_anything_changes(
    spec: str, error: type[Exception], words: list[str]
) -> None:
    model = LM()
    optimizer = torch.optim.AdamW(model.parameters())
    before = _snapshot(model)
    with pytest.raises(error) as raised:
        mpt.wrap(model, optimizer, policy=spec)
    assert all(word in str(raised.value) for word in words), str(raised.value)
    assert _fp8_layers(model) == [] and not hasattr(optimizer, "_mixprec")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_replaced_forward_is_refused_naming_the_module_rule() -> None:
    model = LM()
    model.blocks[1][0].forward = lambda x: x @ model.blocks[1][0].weight.t()  # type: ignore[method-assign]
    with pytest.raises(WrapError, match=r"path:blocks\.1\.0=bfloat16"):
        mpt.wrap(model, policy="O1-fp8")
    assert _fp8_layers(model) == [] and model.lm_head.weight.dtype == torch.float32
    mpt.wrap(model, policy="O1-fp8,path:blocks.1.0=bfloat16")  # the fix it names works
    assert "blocks.1.0" not in _fp8_layers(model) and "lm_head" in _fp8_layers(model)
