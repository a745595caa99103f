"""MixprecPrecision with the real Lightning Trainer: each run is compared with the same
training written as a plain mixprec loop (wrap, scale_loss, unscale_, clip, step), bit for bit.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning")

import torch.nn.functional as F  # noqa: E402
from _lightning_nets import (  # noqa: E402
    BATCH,
    BATCHES,
    INF,
    LIGHTNING_MARKS,
    Net,
    assert_same_weights,
    data,
    fit,
    plain_loop,
    trainer,
)
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import mixprec.torch as mpt  # noqa: E402
from mixprec.errors import CheckpointError, MixprecWarning, WrapError  # noqa: E402
from mixprec.lightning import MixprecPrecision  # noqa: E402

pytestmark = LIGHTNING_MARKS


# --------------------------------------------------------------------------- training


@pytest.mark.parametrize(
    ("policy", "param_dtype", "precision"),
    [
        ("O0", torch.float32, "32-true"),
        ("O1-bf16", torch.float32, "bf16-mixed"),
        ("O2-bf16", torch.bfloat16, "bf16-mixed"),
        ("O1", torch.float32, "16-mixed"),  # float16 with a dynamic loss scale
    ],
)
def test_fit_equals_the_plain_mixprec_loop(
    policy: str, param_dtype: torch.dtype, precision: str
) -> None:
    module, tr = fit(policy)
    assert tr.precision == precision
    assert tr.global_step == 2 * BATCHES
    assert module.net[0].weight.dtype == param_dtype
    assert module.net[1].weight.dtype == torch.float32  # BatchNorm stays float32
    assert_same_weights(module, plain_loop(policy))
    assert all(
        v.dtype == torch.float32 for v in module.state_dict().values() if v.is_floating_point()
    )


def test_a_submodule_called_directly_runs_under_the_policy() -> None:
    """``self.net(x)`` in training_step: O1 casts ops, O2 casts the inputs (no dtype error)."""
    seen: list[torch.dtype] = []
    module = Net()
    module.net[0].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    fit("O1-bf16", 1, module=module, limit_train_batches=1)
    assert seen == [torch.bfloat16]
    module, _ = fit("O2-bf16", 1, limit_train_batches=1, limit_val_batches=1)
    assert module.seen_dtypes == [torch.float32]  # the policy's output dtype
    assert module(torch.randn(2, 8)).dtype == torch.float32  # forward itself unchanged


def test_an_overflow_skips_the_step_and_global_step_still_advances() -> None:
    """float16 O2 with a dynamic scale: the inf step is skipped, the scale halves, and the
    run equals the plain loop with the same overflow."""
    module, tr = fit("O2", module=Net(inject=(2,)))
    assert tr.global_step == 2 * BATCHES  # Lightning counts the skipped step, as under AMP
    plugin = tr.precision_plugin
    state = plugin.mixprec_state()
    assert state.skipped_steps == 1
    assert state.loss_scale == 2.0**15
    assert float(tr.callback_metrics["mixprec/skipped_steps"]) == 1.0
    assert float(tr.callback_metrics["mixprec/loss_scale"]) == 2.0**15
    assert_same_weights(module, plain_loop("O2", inject=(2,)))


@pytest.mark.parametrize("algorithm", ["norm", "value"])
@pytest.mark.parametrize("policy", ["O2-bf16", "O2"])
def test_gradient_clipping_clips_the_unscaled_master_gradients(policy: str, algorithm: str) -> None:
    def clip(params: list[torch.Tensor]) -> None:
        if algorithm == "norm":
            nn.utils.clip_grad_norm_(params, 0.05)
        else:
            nn.utils.clip_grad_value_(params, 0.01)

    value = 0.05 if algorithm == "norm" else 0.01
    module, _ = fit(policy, gradient_clip_val=value, gradient_clip_algorithm=algorithm)
    assert_same_weights(module, plain_loop(policy, clip=clip))
    with pytest.raises(AssertionError):  # the clip made a difference
        assert_same_weights(module, plain_loop(policy))


def test_accumulate_grad_batches_steps_once_per_two_batches() -> None:
    module, tr = fit("O2", accumulate_grad_batches=2)
    assert tr.global_step == BATCHES  # two epochs of two optimizer steps
    assert_same_weights(module, plain_loop("O2", accumulate=2))


def test_manual_optimization_with_clipping() -> None:
    module, tr = fit("O2", module=Net(inject=(1,), manual_clip=0.05))
    assert tr.global_step == 2 * BATCHES
    assert tr.precision_plugin.mixprec_state().skipped_steps == 1

    def clip(params: list[torch.Tensor]) -> None:
        nn.utils.clip_grad_norm_(params, 0.05)

    assert_same_weights(module, plain_loop("O2", inject=(1,), clip=clip))


class TwoOptimizers(L.LightningModule):
    """A GAN-shaped manual loop: two parts, two losses, two optimizers stepping in turn."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 3)
        self.b = nn.Linear(8, 3)
        self.automatic_optimization = False

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)

    def losses(self, batch: Any, batch_idx: int, direct: bool = True) -> Any:
        x, y = batch
        out_a, out_b = (self.a(x), self.b(x)) if direct else self(x)
        loss_a = F.cross_entropy(out_a, y) * (INF if batch_idx == 1 else 1.0)
        return loss_a, F.cross_entropy(out_b, y)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_a, opt_b = self.optimizers()
        for opt, loss in zip((opt_a, opt_b), self.losses(batch, batch_idx), strict=True):
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(m.parameters(), lr=0.1) for m in (self.a, self.b)]


def test_manual_optimization_with_two_optimizers_skips_only_the_overflowing_one() -> None:
    module, tr = fit("O2", 1, module=TwoOptimizers())
    assert tr.global_step == 2 * BATCHES  # Lightning counts each optimizer's step
    state = tr.precision_plugin.mixprec_state()

    plain = TwoOptimizers()
    opts = plain.configure_optimizers()
    plain, opts = mpt.wrap(plain, opts, policy="O2")
    for i, batch in enumerate(DataLoader(data(), batch_size=BATCH)):
        for opt, loss in zip(opts, plain.losses(batch, i, direct=False), strict=True):
            opt.zero_grad()
            with mpt.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
    assert_same_weights(module, plain)
    want = mpt.state(opts[0])
    assert (state.steps, state.skipped_steps, state.loss_scale) == (
        want.steps,
        want.skipped_steps,
        want.loss_scale,
    )
    assert [e.kind for e in state.events] == [e.kind for e in want.events]
    assert state.skipped_steps >= 1


def test_log_state_false_logs_nothing() -> None:
    module = Net()
    tr = L.Trainer(
        plugins=[MixprecPrecision("O2-bf16", log_state=False)],
        max_epochs=1,
        limit_train_batches=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    tr.fit(module, DataLoader(data(), batch_size=BATCH))
    assert tr.global_step == 1
    assert not any(key.startswith("mixprec/") for key in tr.callback_metrics)


@pytest.mark.filterwarnings("ignore:`training_step` returned `None`")
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler")  # no step at all
def test_a_training_step_that_returns_none_steps_nothing() -> None:
    """No loss, no backward: nothing is unscaled or stepped (as under Lightning's AMP)."""
    module = Net()
    module.no_loss = (0, 1, 2, 3)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    _, tr = fit("O2", 1, module=module)
    assert tr.precision_plugin.mixprec_state().steps == 0
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


# --------------------------------------------------------------------------- checkpoints


def test_fit_from_a_checkpoint_resumes_bit_for_bit(tmp_path: Path) -> None:
    """float16 with a skip in the first epoch, so the scale, momentum and LR all moved."""
    whole, whole_tr = fit("O2", 2, module=Net(inject=(1,)))
    _, first_tr = fit("O2", 1, module=Net(inject=(1,)))
    path = tmp_path / "epoch1.ckpt"
    first_tr.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    assert saved["MixprecPrecision"]["scaler"]["loss_scale"]["scale"] == 2.0**15
    resumed = Net(inject=(1,))
    resumed_tr = trainer("O2", 2)
    resumed_tr.fit(resumed, DataLoader(data(), batch_size=BATCH), ckpt_path=path)
    assert resumed_tr.global_step == whole_tr.global_step
    assert_same_weights(resumed, whole)
    assert resumed_tr.precision_plugin.mixprec_state().loss_scale == (
        whole_tr.precision_plugin.mixprec_state().loss_scale
    )
    assert resumed_tr.precision_plugin.mixprec_state().skipped_steps == 1


@pytest.mark.parametrize("policy", ["O3-bf16-kahan", "O3-bf16-sr,state=bfloat16"])
def test_compensated_fit_from_a_checkpoint_resumes_bit_for_bit(policy: str, tmp_path: Path) -> None:
    """Lightning loads the module's weights before the plugin wraps it; the compensation and
    the random stream come back with the optimizer state."""
    whole, _ = fit(policy, 2)
    _, first_tr = fit(policy, 1)
    path = tmp_path / "epoch1.ckpt"
    first_tr.save_checkpoint(path)
    resumed = Net()
    trainer(policy, 2).fit(resumed, DataLoader(data(), batch_size=BATCH), ckpt_path=path)
    assert_same_weights(resumed, whole)


def test_validate_after_fit_reuses_the_wrap_and_a_second_fit_is_refused() -> None:
    module, tr = fit("O2-bf16", 1)
    loader = DataLoader(data(), batch_size=BATCH)
    (metrics,) = tr.validate(module, loader, verbose=False)
    assert metrics["val_loss"] > 0
    with pytest.raises(WrapError, match="fresh module"):
        trainer("O2-bf16", 1).fit(module, loader)
    fresh = Net()  # validate alone wraps without optimizers
    (metrics,) = trainer("O2-bf16").validate(fresh, loader, verbose=False)
    assert metrics["val_loss"] > 0
    assert fresh.net[0].weight.dtype == torch.bfloat16


def test_resuming_under_another_policy_says_so(tmp_path: Path) -> None:
    """The plugin took the saved scaler state under its own, different policy without a
    word (issue 21)."""
    _, first_tr = fit("O2-bf16", 1)
    path = tmp_path / "epoch1.ckpt"
    first_tr.save_checkpoint(path)
    resumed_tr = trainer("O1-bf16", 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", MixprecWarning)
        resumed_tr.fit(Net(), DataLoader(data(), batch_size=BATCH), ckpt_path=path)
    said = [str(w.message) for w in caught if issubclass(w.category, MixprecWarning)]
    # the plugin says so (the optimizers' own state dicts say it for themselves too)
    assert any(
        re.search(r"saved under policy O2-bf16 but this Trainer's MixprecPrecision runs O1-bf16", m)
        for m in said
    ), said


def test_a_malformed_saved_policy_is_refused_before_any_change() -> None:
    _, tr = fit("O2-bf16", 1)
    plugin = tr.precision_plugin
    before = plugin.state_dict()
    with pytest.raises(CheckpointError, match="malformed policy"):
        plugin.load_state_dict({**before, "policy": {"base": 5}})
    assert plugin.state_dict() == before
