"""Reentrant checkpointing of a plain function under O1: recomputed under the forward's op
casting where every plain function runs in one decision context; otherwise not silent: a
warning names the function and the two fixes. Every case recomputed correctly stays quiet."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
from torch.utils.checkpoint import checkpoint  # noqa: E402

import mixprec  # noqa: E402
from mixprec.policy import Policy  # noqa: E402
from mixprec_torch.reentrant import CHECKED_FORWARDS, ReentrantCheckpointWarning  # noqa: E402

WIDTH = 4


def attention(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """A plain function whose softmax O1-bf16 runs in float32 and CPU autocast in bfloat16."""
    return torch.softmax(q @ k.transpose(-1, -2), -1) @ k


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return attention(self.fc(x), x)


class Net(nn.Module):
    """``how`` says what the forward checkpoints (None: nothing)."""

    def __init__(self, how: str | None) -> None:
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(WIDTH, 2)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block.fc(x)
        how = self.how
        if how == "plain":
            h = checkpoint(attention, h, x, use_reentrant=True)
        elif how == "partial-plain":
            h = checkpoint(functools.partial(attention, k=x), h, use_reentrant=True)
        elif how == "module":
            h = checkpoint(self.block, x, use_reentrant=True)
        elif how == "bound-call":  # Hugging Face before GradientCheckpointingLayer
            h = checkpoint(self.block.__call__, x, use_reentrant=True)
        elif how == "partial-call":  # Hugging Face's GradientCheckpointingLayer
            h = checkpoint(functools.partial(self.block.__call__), x, use_reentrant=True)
        elif how == "sequential":
            seq = nn.Sequential(self.block)
            h = torch.utils.checkpoint.checkpoint_sequential(seq, 1, x, use_reentrant=True)
        elif how == "context-fn":
            h = checkpoint(
                attention,
                h,
                x,
                use_reentrant=False,
                context_fn=mixprec.torch.checkpoint_context,
            )
        else:
            h = attention(h, x)
        return self.head(h)  # type: ignore[no-any-return]


RULED = mixprec.get_policy("O1-bf16").with_module("Block", match="class", ops={"exp": "lowp"})
"""O1-bf16 with a rule on a module class of the user's own: a plain function may run in its
context, which a graph node does not record, so mixprec warns instead of repairing."""


def _wrapped(how: str | None, policy: str | Policy = "O1-bf16") -> nn.Module:
    torch.manual_seed(0)
    model = Net(how)
    wrapped, _ = mixprec.torch.wrap(
        model, torch.optim.SGD(model.parameters(), lr=0.1), policy=policy
    )
    return wrapped  # type: ignore[no-any-return]


def _x() -> torch.Tensor:
    return torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(1), requires_grad=True)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    model(_x()).float().pow(2).sum().backward()
    return [p.grad.float().clone() for p in model.parameters()]


@pytest.mark.parametrize("how", ["plain", "partial-plain"])
def test_a_reentrant_plain_function_under_o1_is_recomputed_with_the_forwards_casting(
    how: str,
) -> None:
    """The checkpoint's recomputation runs under O1's op casting (softmax in float32), past
    the first checked forwards too: the gradients of the same model without checkpointing."""
    model = _wrapped(how)
    expected = _grads(_wrapped(None))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReentrantCheckpointWarning)
        for _ in range(CHECKED_FORWARDS + 2):
            model.zero_grad()
            got = _grads(model)
            for e, g in zip(expected, got, strict=True):
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("how", ["plain", "partial-plain"])
def test_a_plain_function_in_a_model_with_rules_of_its_own_warns_once_naming_the_fixes(
    how: str,
) -> None:
    model = _wrapped(how, RULED)
    with pytest.warns(ReentrantCheckpointWarning) as caught:
        model(_x())
        model(_x())
        got = _grads(model)
    assert len(caught) == 1  # once per function, not once per forward
    message = str(caught[0].message)
    assert "attention" in message and "O1-bf16" in message
    assert "Checkpoint a module" in message
    assert "use_reentrant=False, context_fn=mixprec.torch.checkpoint_context" in message
    assert caught[0].filename == __file__  # points at the user's forward call
    # what the warning is about: the gradients differ from those of the plain forward
    expected = _grads(_wrapped(None, RULED))
    assert not all(torch.equal(e, g) for e, g in zip(expected, got, strict=True))
    assert mixprec.torch.ReentrantCheckpointWarning is ReentrantCheckpointWarning
    assert issubclass(ReentrantCheckpointWarning, mixprec.MixprecWarning)


@pytest.mark.parametrize(
    "how", ["module", "bound-call", "partial-call", "sequential", "context-fn", None]
)
def test_what_is_recomputed_with_o1_casting_does_not_warn(how: str | None) -> None:
    model = _wrapped(how)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReentrantCheckpointWarning)
        got = _grads(model)
    # and it is recomputed right: the gradients of the plain forward (reentrant backward
    # adds float32 sums in another order: float32 rounding, not bit for bit)
    for e, g in zip(_grads(_wrapped(None)), got, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["O2-bf16", "O0"])
def test_policies_without_the_op_casting_mode_do_not_warn(policy: str) -> None:
    """Outside O1's op-casting mode the recomputation runs as the forward ran."""
    model = _wrapped("plain", policy)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReentrantCheckpointWarning)
        got = _grads(model)
    for e, g in zip(_grads(_wrapped(None, policy)), got, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def _forward(model: nn.Module, grad: bool) -> Any:
    with torch.set_grad_enabled(grad), warnings.catch_warnings():
        # no grad: torch.utils.checkpoint itself warns that no input requires grad
        warnings.filterwarnings("ignore", "None of the inputs have requires_grad")
        return model(_x())


def test_the_check_runs_only_on_the_first_forwards_with_a_graph() -> None:
    model = _wrapped(None, RULED)
    for _ in range(5):
        _forward(model, grad=False)  # no graph: not counted, nothing walked
    for _ in range(CHECKED_FORWARDS):
        _forward(model, grad=True)
    model.how = "plain"  # checkpointed from now on: the check is spent, so no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReentrantCheckpointWarning)
        _forward(model, grad=True)

    fresh = _wrapped(None, RULED)
    for _ in range(CHECKED_FORWARDS - 1):
        _forward(fresh, grad=True)
    fresh.how = "plain"
    with pytest.warns(ReentrantCheckpointWarning):
        _forward(fresh, grad=True)


def test_no_grad_and_inference_forwards_do_not_warn() -> None:
    model = _wrapped("plain", RULED)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReentrantCheckpointWarning)
        warnings.filterwarnings("ignore", "None of the inputs have requires_grad")
        with torch.no_grad():
            model(_x())
        with torch.inference_mode():
            model(_x())
