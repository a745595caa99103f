"""O1: every op family runs in the dtype ``Policy.decide`` gives, inside a wrapped forward."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import mixprec  # noqa: E402
import mixprec.torch as mpt  # noqa: E402
from mixprec.errors import PolicyError  # noqa: E402
from mixprec_torch.dtypes import dtype_name, torch_dtype  # noqa: E402
from mixprec_torch.o1.decision_tables import BAN_KEYS  # noqa: E402
from mixprec_torch.o1.probes import PROBES, result_dtype  # noqa: E402
from mixprec_torch.ops import supported_ops  # noqa: E402

pytestmark = pytest.mark.torch

FAMILIES = supported_ops()


class OpRunner(nn.Module):
    """Runs the representative call of one family in its forward and records the dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1))  # the model has a device and a parameter
        self.seen: dict[str, str] = {}

    def forward(self, family: str, dtype: torch.dtype) -> torch.Tensor:
        n, run = PROBES[family][0]
        out = run((dtype,) * n, torch.device("cpu"))
        self.seen[family] = dtype_name(result_dtype(out))
        return self.anchor


def run_families(policy: Any, input_dtype: str) -> dict[str, str | type[Exception]]:
    model = mpt.wrap(OpRunner(), policy=policy)
    out: dict[str, str | type[Exception]] = {}
    with torch.no_grad():
        for family in FAMILIES:
            try:
                model(family, torch_dtype(input_dtype))
                out[family] = model.seen[family]
            except PolicyError:
                out[family] = PolicyError
    return out


def decided(policy: mixprec.Policy, input_dtype: str) -> dict[str, str | type[Exception]]:
    out: dict[str, str | type[Exception]] = {}
    for family in FAMILIES:
        n = PROBES[family][0][0]
        try:
            out[family] = policy.decide(family, (input_dtype,) * n).dtype
        except PolicyError:
            out[family] = PolicyError
    return out


EDITED = mixprec.get_policy("O1-bf16").with_ops(
    lowp=["softmax", "layer_norm"], fp32=["linear", "matmul"]
)


@pytest.mark.parametrize(
    "policy",
    [mixprec.get_policy("O1-bf16"), mixprec.get_policy("O1"), EDITED],
    ids=["O1-bf16", "O1", "edited"],
)
@pytest.mark.parametrize("input_dtype", ["float32", "bfloat16"])
def test_every_family_runs_in_the_decided_dtype(policy: mixprec.Policy, input_dtype: str) -> None:
    assert run_families(policy, input_dtype) == decided(policy, input_dtype)


def test_policy_wins_where_cpu_autocast_differs() -> None:
    """CPU autocast leaves softmax/layer_norm/exp in bfloat16; the default policy does not."""
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.softmax(x.bfloat16(), -1).dtype == torch.bfloat16  # autocast alone
    seen = run_families("O1-bf16", "bfloat16")
    assert seen["softmax"] == seen["layer_norm"] == seen["exp"] == "float32"
    assert seen["linear"] == seen["conv"] == "bfloat16"


def test_edited_lists_move_ops_both_ways() -> None:
    seen = run_families(EDITED, "float32")
    assert seen["softmax"] == "bfloat16" and seen["layer_norm"] == "bfloat16"
    assert seen["linear"] == "float32" and seen["matmul"] == "float32"
    assert seen["bmm"] == "bfloat16"  # untouched


def test_banned_op_raises_the_policy_error() -> None:
    model = mpt.wrap(OpRunner(), policy="O1")
    with pytest.raises(PolicyError, match="binary_cross_entropy_with_logits"):
        model("binary_cross_entropy", torch.float32)


@pytest.mark.parametrize("policy", ["O2", "O3"])
def test_a_passthrough_preset_checks_its_bans_without_o1s_table(policy: str) -> None:
    """float16's lists ban ``binary_cross_entropy``. Under O2/O3 (no autocast) its kernel only
    asks whether the op is refused, whatever floating inputs come: ``wrap`` prepares one
    answer per op and context (and one for no floating input), not O1's 33 input keys, and a
    forward adds none."""
    model = mpt.wrap(OpRunner(), policy=policy)
    decisions = model._mixprec.casting.casting.decisions
    assert decisions.ops == ("binary_cross_entropy",)
    sizes = {id(t): len(t) for t in decisions.tables.values()}
    assert set(sizes.values()) == {len(BAN_KEYS)}
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        with pytest.raises(PolicyError, match="binary_cross_entropy_with_logits"):
            model("binary_cross_entropy", dtype)
    model("softmax", torch.float16)  # everything else runs as torch runs it
    assert model.seen["softmax"] == "float16"
    assert {id(t): len(t) for t in decisions.tables.values()} == sizes


# ------------------------------------------------------------------------------- modules


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.seen: dict[str, torch.dtype] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        s = torch.softmax(h, -1)
        self.seen = {"linear": h.dtype, "softmax": s.dtype}
        return s


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.attn = Attn()
        self.seen: dict[str, torch.dtype] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        self.seen = {"linear": h.dtype, "softmax": torch.softmax(h, -1).dtype}
        return self.attn(h)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = Block()
        self.head = nn.Linear(8, 2)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(x)
        self.bn_in = self.bn(h).dtype
        return self.head(h)


def seen_under(policy: mixprec.Policy) -> dict[str, Any]:
    net = mpt.wrap(Net(), policy=policy)
    net(torch.randn(4, 8))
    return {"block": net.block.seen, "attn": net.block.attn.seen, "bn": net.bn_in}


def expected(policy: mixprec.Policy, net: nn.Module, name: str, op: str) -> torch.dtype:
    from mixprec_torch.wrapping.casting import class_names

    module = net.get_submodule(name)
    return torch_dtype(policy.decide(op, ("float32",), name, class_names(module)).dtype)


def test_module_pinned_to_float32_runs_float32_inside_an_o1_region() -> None:
    policy = mixprec.get_policy("O1-bf16").with_module("Block", "float32")
    seen = seen_under(policy)
    # every op inside Block (and inside its children, which have no rule) is float32
    assert seen["block"] == {"linear": torch.float32, "softmax": torch.float32}
    assert seen["attn"] == {"linear": torch.float32, "softmax": torch.float32}
    assert seen["bn"] == torch.float32  # O1 pins *BatchNorm* too


def test_path_rule_beats_class_rule_and_module_op_rule_beats_both() -> None:
    policy = (
        mixprec.get_policy("O1-bf16")
        .with_module("Attn", "float32")  # class rule: pin Attn to float32
        .with_module("block.attn", "bfloat16", match="path")  # path rule wins: bfloat16
        .with_module("block", match="path", ops={"softmax": "lowp"})  # op rule in block only
    )
    net = Net()
    seen = seen_under(policy)
    assert seen["attn"]["linear"] == torch.bfloat16 == expected(policy, net, "block.attn", "linear")
    assert (
        seen["attn"]["softmax"] == torch.bfloat16 == expected(policy, net, "block.attn", "softmax")
    )
    # inside block: softmax moved to lowp by the module op rule; linear as globally
    assert seen["block"]["softmax"] == torch.bfloat16 == expected(policy, net, "block", "softmax")
    assert seen["block"]["linear"] == torch.bfloat16
    # outside any rule, softmax stays float32
    assert seen_under(mixprec.get_policy("O1-bf16"))["block"]["softmax"] == torch.float32


def test_module_op_rule_applies_inside_the_module_only() -> None:
    policy = mixprec.get_policy("O1-bf16").with_module(
        "Attn", ops={"softmax": "lowp", "linear": "fp32"}
    )
    seen = seen_under(policy)
    assert seen["attn"] == {"linear": torch.float32, "softmax": torch.bfloat16}
    assert seen["block"] == {"linear": torch.bfloat16, "softmax": torch.float32}


def test_ambiguous_module_rules_are_refused_at_wrap() -> None:
    policy = (
        mixprec.get_policy("O1-bf16").with_module("Attn", "float32").with_module("*ttn", "bfloat16")
    )
    with pytest.raises(PolicyError, match="ambiguous"):
        mpt.wrap(Net(), policy=policy)


def test_outputs_leave_the_model_in_the_output_dtype() -> None:
    net = mpt.wrap(nn.Linear(8, 2), policy="O1-bf16")
    assert net(torch.randn(3, 8)).dtype == torch.float32
    net3 = mpt.wrap(nn.Linear(8, 2), policy="O3-bf16")
    assert net3(torch.randn(3, 8)).dtype == torch.bfloat16  # O3 outputs lowp


def test_native_torch_names_are_honoured() -> None:
    class PReLUNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.act = nn.PReLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.act(self.fc(x))
            self.seen = (h.dtype, torch.addmm(x, x, x.T[:, :8]).dtype)
            return h

    # torch:prelu -> float32, torch:aten::addmm -> float32 (addmm is in the linear family)
    policy = mixprec.get_policy("O1-bf16").with_ops(fp32=["torch:prelu", "torch:aten::addmm"])
    net = mpt.wrap(PReLUNet(), policy=policy)
    net(torch.randn(8, 8))
    assert net.seen == (torch.float32, torch.float32)
    plain = mpt.wrap(PReLUNet(), policy="O1-bf16")
    plain(torch.randn(8, 8))
    assert plain.seen == (torch.bfloat16, torch.bfloat16)
    with pytest.raises(PolicyError, match="no ATen operator named 'nope'"):
        mpt.wrap(PReLUNet(), policy=mixprec.get_policy("O1-bf16").with_ops(fp32=["torch:nope"]))


def test_an_error_in_forward_leaves_no_autocast_or_mode_behind() -> None:
    class Boom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.bn(self.fc(x))
            raise ValueError("boom")

    net = mpt.wrap(Boom(), policy="O1-bf16")
    with pytest.raises(ValueError, match="boom"):
        net(torch.randn(2, 4))
    assert not torch.is_autocast_enabled("cpu")
    assert F.softmax(torch.randn(2, 3, dtype=torch.bfloat16), -1).dtype == torch.bfloat16
    from torch.overrides import _get_current_function_mode_stack

    assert _get_current_function_mode_stack() == []


def test_a_deep_copy_of_a_wrapped_model_keeps_casting() -> None:
    import copy

    net = mpt.wrap(Net(), policy="O1-bf16")
    twin = copy.deepcopy(net)
    out = twin(torch.randn(4, 8))
    assert out.dtype == torch.float32 and twin.block.seen["linear"] == torch.bfloat16
    assert twin.block.seen["softmax"] == torch.float32
