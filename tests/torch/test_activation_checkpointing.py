"""Activation checkpointing under mixprec with no change to the model's code.

``torch.utils.checkpoint`` recomputes a checkpointed callable during backward, after the
wrapped model's forward returned. Whatever is checkpointed (a function, a module, a bound
method, a ``functools.partial``, a lambda, ``checkpoint_sequential``), in either
``use_reentrant`` mode, and Hugging Face's ``gradient_checkpointing_enable()``, the gradients
must be those of the same model without checkpointing: bit for bit, under O1-bf16 and O1
(float16 on tiny tensors) and O2-bf16. The blocks run ops the O1 policies decide differently
from CPU autocast (``layer_norm`` and ``softmax`` in float32), so a recomputation that lost
the policy would differ (or trip torch's ``CheckpointError``).
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential  # noqa: E402

import mixprec  # noqa: E402

WIDTH = 8


class Block(nn.Module):
    """Ops O1 runs differently from CPU autocast (layer_norm, softmax), ending in a Linear
    so the block's output stays low precision under O1."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.out(torch.softmax(self.norm(self.fc(x)) * scale, -1))


def attention(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """A plain function (no module, so no hook sees its recomputation)."""
    return torch.softmax(q @ k.transpose(-1, -2), -1) @ k


FORMS = ("function", "module", "bound-method", "partial", "lambda", "sequential")


class Net(nn.Module):
    """Two blocks and an attention function; ``form`` says how the forward checkpoints them
    (None: no checkpointing), ``reentrant`` in which mode."""

    def __init__(self) -> None:
        super().__init__()
        self.b1 = Block()
        self.b2 = Block()
        self.q = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 3)
        self.form: str | None = None
        self.reentrant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        form, r = self.form, self.reentrant

        def ckpt(fn: Callable[..., Any], *args: Any) -> Any:
            return checkpoint(fn, *args, use_reentrant=r)

        if form is None:
            h = self.b2(self.b1(x), scale=2.0)
            h = attention(self.q(h), h)
        elif form == "function":
            h = self.b2(self.b1(x), scale=2.0)
            h = ckpt(attention, self.q(h), h)
        elif form == "module":
            h = ckpt(self.b2, ckpt(self.b1, x), 2.0)
            h = attention(self.q(h), h)
        elif form == "bound-method":
            h = ckpt(self.b1.forward, x)
            h = ckpt(self.b2.forward, h, 2.0)
            h = attention(self.q(h), h)
        elif form == "partial":
            h = ckpt(functools.partial(self.b1), x)
            h = ckpt(functools.partial(self.b2, scale=2.0), h)
            h = ckpt(functools.partial(attention), self.q(h), h)
        elif form == "lambda":
            h = ckpt(lambda t: self.b2(self.b1(t), scale=2.0), x)
            h = ckpt(lambda a, b: attention(a, b), self.q(h), h)
        elif form == "sequential":
            h = checkpoint_sequential(
                nn.Sequential(self.b1, Scaled(self.b2)), 2, x, use_reentrant=r
            )
            h = attention(self.q(h), h)
        else:
            raise ValueError(form)
        return self.head(h)  # type: ignore[no-any-return]


class Scaled(nn.Module):
    """``block(x, scale=2.0)`` as a module (checkpoint_sequential passes one input)."""

    def __init__(self, block: Block) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x, scale=2.0)  # type: ignore[no-any-return]


def _grads(
    model: nn.Module, policy: Any, run: Callable[[nn.Module], torch.Tensor]
) -> list[torch.Tensor]:
    model, _ = mixprec.torch.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=policy)
    run(model).backward()
    return [p.grad.float() for p in model.parameters() if p.grad is not None]


def _net_grads(base: Net, policy: Any, form: str | None, reentrant: bool) -> list[torch.Tensor]:
    # an input that requires grad: reentrant checkpointing gives no gradients without one
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1), requires_grad=True)
    model = copy.deepcopy(base)
    model.form, model.reentrant = form, reentrant
    return _grads(model, policy, lambda m: m(x).float().pow(2).sum())


def _assert_same(expected: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    assert len(got) == len(expected) == 16
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g), (e - g).abs().max()


@pytest.mark.parametrize("policy", ["O1-bf16", "O1"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("form", FORMS)
def test_every_checkpointed_callable_gives_the_gradients_of_the_plain_forward(
    policy: str, reentrant: bool, form: str
) -> None:
    torch.manual_seed(0)
    base = Net()
    expected = _net_grads(base, policy, None, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and nothing warns
        got = _net_grads(base, policy, form, reentrant)
    _assert_same(expected, got)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_o2_checkpointing_gives_the_gradients_of_the_plain_forward(reentrant: bool) -> None:
    torch.manual_seed(0)
    base = Net()
    expected = _net_grads(base, "O2-bf16", None, False)
    _assert_same(expected, _net_grads(base, "O2-bf16", "partial", reentrant))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_function_checkpointed_inside_a_ruled_module_keeps_that_modules_rules(
    reentrant: bool,
) -> None:
    """The module rule's op lists apply inside the module only; a plain function
    checkpointed there is recomputed under them (softmax in bfloat16 inside Block only)."""

    class Inner(Block):
        ckpt = False
        reentrant = False

        def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            h = self.norm(self.fc(x))
            if self.ckpt:
                return checkpoint(attention, h, x, use_reentrant=self.reentrant)  # type: ignore[no-any-return]
            return attention(h, x)

    class Outer(nn.Module):
        def __init__(self, ckpt: bool) -> None:
            super().__init__()
            self.inner = Inner()
            self.inner.ckpt = ckpt
            self.inner.reentrant = reentrant
            self.head = nn.Linear(WIDTH, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.softmax(self.inner(x), -1))  # type: ignore[no-any-return]

    policy = mixprec.get_policy("O1-bf16").with_module("Inner", ops={"softmax": "lowp"})
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(0)
    base = Outer(False)
    seen: list[torch.dtype] = []
    base.inner.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    expected = _grads(base, policy, lambda m: m(x).float().sum())
    assert seen == [torch.bfloat16]  # the rule held: attention's softmax ran in bfloat16
    checkpointed = Outer(True)
    checkpointed.load_state_dict(base.state_dict())
    got = _grads(checkpointed, policy, lambda m: m(x).float().sum())
    assert all(torch.equal(e, g) for e, g in zip(expected, got, strict=True))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_recomputed_module_returns_what_its_forward_returned(reentrant: bool) -> None:
    """Inside the forward a block hands on low-precision values; its recomputation must too
    (not the float32 a call from outside the model's forward returns)."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.Linear(WIDTH, 2))

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # early_stop=False: the recomputation runs the block to its end (by default
            # it stops after the last saved tensor, before the block returns)
            extra = {} if reentrant else {"early_stop": False}
            h = checkpoint(self.net[0], x, use_reentrant=reentrant, **extra)
            return self.net[1](h)  # type: ignore[no-any-return]

    wrapped, _ = mixprec.torch.wrap(
        Checkpointed(), torch.optim.SGD(model.parameters(), lr=0.1), policy="O1-bf16"
    )
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    wrapped(torch.randn(4, WIDTH, requires_grad=True)).sum().backward()
    assert seen == [torch.bfloat16, torch.bfloat16]  # forward, then the recomputation


def test_checkpoint_context_still_works_and_does_nothing_outside_a_region() -> None:
    """Code written for earlier versions passes it; the gradients are the same."""
    forward, recompute = mixprec.torch.checkpoint_context()
    with forward, recompute:
        assert torch.softmax(torch.ones(2, dtype=torch.bfloat16), 0).dtype == torch.bfloat16

    class WithContext(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.b2(self.b1(x), scale=2.0)
            h = checkpoint(
                attention,
                self.q(h),
                h,
                use_reentrant=False,
                context_fn=mixprec.torch.checkpoint_context,
            )
            return self.head(h)  # type: ignore[no-any-return]

    torch.manual_seed(0)
    base = Net()
    expected = _net_grads(base, "O1-bf16", None, False)
    model = WithContext()
    model.load_state_dict(base.state_dict())
    _assert_same(expected, _net_grads(model, "O1-bf16", None, False))


# ------------------------------------------------------------------------------- transformers


def _hf_model(kind: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "bert":
        return transformers.BertForSequenceClassification(
            transformers.BertConfig(
                vocab_size=64,
                hidden_size=16,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=32,
                max_position_embeddings=16,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
                num_labels=3,
            )
        )
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=64,
            n_embd=16,
            n_layer=2,
            n_head=2,
            n_positions=16,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    )


def _hf_grads(kind: str, reentrant: bool | None) -> list[torch.Tensor]:
    model = _hf_model(kind)
    model.train()
    if reentrant is not None:
        with warnings.catch_warnings():  # transformers 5 names it activation_checkpointing_enable
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": reentrant}
            )
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    labels = torch.tensor([0, 2]) if kind == "bert" else ids

    extra = {"use_cache": False} if kind == "gpt2" else {}

    def run(m: nn.Module) -> torch.Tensor:
        with warnings.catch_warnings():  # transformers' notes on its config defaults
            warnings.simplefilter("ignore")
            return m(input_ids=ids, labels=labels, **extra).loss  # type: ignore[no-any-return]

    return _grads(model, "O1-bf16", run)


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_hf_gradient_checkpointing_under_o1(kind: str, reentrant: bool) -> None:
    expected = _hf_grads(kind, None)
    got = _hf_grads(kind, reentrant)
    assert len(got) == len(expected)
    for e, g in zip(expected, got, strict=True):
        # reentrant mode runs one backward per layer, so float32 gradient sums may add up
        # in another order: equal to float32 rounding, not bit for bit
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
