"""The Lightning module, Trainer and plain mixprec loop the Lightning tests compare.

Imported by ``test_lightning.py`` and ``test_lightning_closures.py`` after they skip without
Lightning (``tests/torch/conftest.py`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mixprec.torch as mpt
from mixprec.lightning import MixprecPrecision

#: The marks of every Lightning test module (``pytestmark = LIGHTNING_MARKS``).
LIGHTNING_MARKS = [
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
