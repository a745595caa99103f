"""MixprecPrecision with the real Lightning Trainer: each run is compared with the same
training written as a plain mixprec loop (wrap, scale_loss, unscale_, clip, step), bit for bit.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import mixprec.torch as mpt  # noqa: E402
from mixprec.errors import PolicyError, WrapError  # noqa: E402
from mixprec.lightning import MixprecPrecision  # noqa: E402

pytestmark = [
    pytest.mark.torch,
    # Lightning's own advice (DataLoader workers, log intervals) and its pytree shim on torch 2.13
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"),
]

BATCHES, BATCH = 4, 16
INF = float("inf")


def data() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(BATCHES * BATCH, 8, generator=gen) * 3
    return TensorDataset(x, torch.randint(0, 3, (BATCHES * BATCH,), generator=gen))


class Net(L.LightningModule):
    """A tiny classifier whose training_step calls ``self.net`` directly (issue 10, item 5)."""

    def __init__(self, *, inject: tuple[int, ...] = (), manual_clip: float | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
        self.inject = inject
        self.manual_clip = manual_clip
        self.automatic_optimization = manual_clip is None
        self.seen_dtypes: list[torch.dtype] = []
        self.no_loss: tuple[int, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss(self, batch: Any, step: int, *, direct: bool = True) -> torch.Tensor:
        x, y = batch
        logits = self.net(x) if direct else self(x)
        self.seen_dtypes.append(logits.dtype)
        loss = F.cross_entropy(logits, y)
        return loss * INF if step in self.inject else loss

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.automatic_optimization:
            return None if batch_idx in self.no_loss else self.loss(batch, self.global_step)
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.loss(batch, self.global_step))
        self.clip_gradients(opt, gradient_clip_val=self.manual_clip, gradient_clip_algorithm="norm")
        opt.step()
        if self.trainer.is_last_batch:  # manual optimization steps its schedulers itself
            self.lr_schedulers().step()
        return None

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", F.cross_entropy(self.net(batch[0]), batch[1]))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


def trainer(policy: str, epochs: int = 2, **kwargs: Any) -> Any:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": epochs,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        **kwargs,
    }
    return L.Trainer(plugins=[MixprecPrecision(policy)], **options)


def fit(policy: str, epochs: int = 2, *, module: Net | None = None, **kwargs: Any) -> Any:
    module = module if module is not None else Net()
    tr = trainer(policy, epochs, **kwargs)
    tr.fit(module, DataLoader(data(), batch_size=BATCH))
    return module, tr


def plain_loop(
    policy: str,
    epochs: int = 2,
    *,
    inject: tuple[int, ...] = (),
    clip: Callable[[list[torch.Tensor]], Any] | None = None,
    accumulate: int = 1,
) -> Net:
    """The same training as a hand-written mixprec loop."""
    module = Net(inject=inject)
    opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    module, opt = mpt.wrap(module, opt, policy=policy)
    loader = DataLoader(data(), batch_size=BATCH)
    step = 0
    for _ in range(epochs):
        for i, batch in enumerate(loader):
            if i % accumulate == 0:
                opt.zero_grad()
            loss = module.loss(batch, step, direct=False)
            with mpt.scale_loss(loss / accumulate if accumulate > 1 else loss, opt) as scaled:
                scaled.backward()
            if (i + 1) % accumulate:
                continue
            mpt.unscale_(opt)
            if clip is not None:
                clip(mpt.master_params(opt))
            opt.step()
            step += 1
        sched.step()
    return module


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


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


# --------------------------------------------------------------------------- bad input, imports


@pytest.mark.parametrize(
    ("policy", "name"),
    [("O0", "32-true"), ("O1", "16-mixed"), ("O2", "16-mixed"), ("O1-bf16", "bf16-mixed"),
     ("O2-bf16", "bf16-mixed"), ("O3", "16-true"), ("O3-bf16", "bf16-true"), ("auto", "32-true")],
)  # fmt: skip
def test_trainer_precision_reports_lightnings_name_for_the_policy(policy: str, name: str) -> None:
    assert MixprecPrecision(policy).precision == name


class WithLBFGS(Net):
    """The same classifier trained by LBFGS, which re-runs Lightning's closure in step()."""

    def configure_optimizers(self) -> Any:
        return lbfgs(self)


def lbfgs(module: nn.Module) -> torch.optim.LBFGS:
    return torch.optim.LBFGS(module.parameters(), lr=0.5, max_iter=4)


def batch_loss(module: Net) -> float:
    """The loss on the first batch, with batch statistics (running stats move: call last)."""
    x, y = data()[:BATCH]
    with torch.no_grad():
        return float(F.cross_entropy(module.train()(x), y))


def test_lbfgs_trains_under_o2_bf16_as_the_plain_closure_loop() -> None:
    """Five LBFGS steps on one batch: Lightning's run equals mixprec's own closure loop."""
    start = batch_loss(WithLBFGS())
    module, tr = fit("O2-bf16", 5, module=WithLBFGS(), limit_train_batches=1)
    assert tr.global_step == 5
    assert module.net[0].weight.dtype == torch.bfloat16
    assert tr.precision_plugin.mixprec_state().skipped_steps == 0
    # LBFGS's line search re-ran Lightning's closure: more forwards than steps
    assert len(module.seen_dtypes) > 5

    plain = WithLBFGS()
    plain_model, opt = mpt.wrap(plain, lbfgs(plain), policy="O2-bf16")
    first = next(iter(DataLoader(data(), batch_size=BATCH)))

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = plain.loss(first, 0, direct=False)
        loss.backward()
        return loss

    for _ in range(5):
        opt.step(closure)
    assert_same_weights(module, plain_model)
    assert batch_loss(module) < 0.5 * start


def test_lbfgs_clips_the_float32_master_gradients_once_per_step() -> None:
    norms: list[float] = []

    class Clipped(WithLBFGS):
        def configure_gradient_clipping(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
            super().configure_gradient_clipping(optimizer, *args, **kwargs)
            grads = [m.grad for m in mpt.master_params(optimizer)]
            assert all(g is not None and g.dtype == torch.float32 for g in grads)
            norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    module, tr = fit("O2-bf16", 1, module=Clipped(), gradient_clip_val=0.05)
    assert tr.global_step == BATCHES
    assert len(norms) == BATCHES  # not once per line-search evaluation
    assert all(n <= 0.05 * 1.001 for n in norms)
    assert len(module.seen_dtypes) > BATCHES


def test_bad_policy_and_lbfgs_under_loss_scaling_are_refused_before_training() -> None:
    with pytest.raises(PolicyError):
        MixprecPrecision("O9")
    module = WithLBFGS()
    before = module.net[0].weight.detach().clone()
    with pytest.raises(WrapError, match="LBFGS") as refused:
        fit("O2", 1, module=module)
    assert "O2-bf16" in str(refused.value)  # the fix it names
    assert module.net[0].weight.dtype == torch.float32
    assert torch.equal(module.net[0].weight, before)


def test_mixprec_lightning_without_lightning_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['lightning'] = None\n"
        "import mixprec\n"
        "assert 'torch' not in sys.modules\n"
        "try:\n"
        "    import mixprec.lightning\n"
        "except mixprec.BackendNotAvailable as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert "pip install 'mixprec[lightning]'" in out


def test_the_lightning_digits_example_trains(capsys: pytest.CaptureFixture[str]) -> None:
    root = Path(__file__).resolve().parents[2]
    runpy.run_path(str(root / "examples/lightning_digits.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "precision bf16-mixed, policy O2-bf16" in out  # its asserts check the accuracy


def test_a_strategy_that_wraps_the_module_first_is_refused_clearly() -> None:
    module = Net()
    environ = dict(os.environ)
    tr = trainer("O2-bf16", 1, strategy="ddp")
    try:
        with pytest.raises(WrapError, match="single-device strategy"):
            tr.fit(module, DataLoader(data(), batch_size=BATCH))
    finally:  # undo the one-rank gloo group and the variables Lightning's DDP set up
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
    assert module.net[0].weight.dtype == torch.float32
