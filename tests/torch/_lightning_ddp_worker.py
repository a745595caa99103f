"""One process of the Lightning DDP tests (``test_distributed.py``).

``python _lightning_ddp_worker.py ddp RANK WORKDIR PORT [CONFIGS]``: one of two processes the test
starts itself, with the variables of Lightning's own launcher (``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``), so Lightning's real ``Trainer(accelerator="cpu",
devices=2, strategy="ddp")`` joins them. ``python _lightning_ddp_worker.py ddp_spawn 0 WORKDIR
PORT``: one process whose Trainer spawns the two ranks itself. Each rank trains the same tiny
module under mixprec's plugin and under Lightning's own ``bf16-mixed`` and writes
``WORKDIR/<strategy>-<config>-rank<RANK>.json`` at the end of each fit.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mixprec.torch as mpt
from mixprec.lightning import MixprecPrecision

STEPS = 4


class Tiny(L.LightningModule):
    def __init__(self, out: Path) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        self.losses: list[float] = []
        self.out = out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).float(), y)
        self.losses.append(loss.item())
        self.wrappers = [self.trainer.strategy.model]  # a list: not a submodule
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.2)

    def on_train_end(self) -> None:
        """In every rank (spawned ones too), before the strategy's teardown."""
        out: dict[str, Any] = {
            "losses": self.losses,
            "params": [p.detach().float().flatten().tolist() for p in self.parameters()],
            "dtypes": sorted({str(p.dtype) for p in self.parameters()}),
        }
        optimizer = self.trainer.optimizers[0]
        if hasattr(optimizer, "_mixprec"):
            from mixprec_torch.step.distributed import consensus_group

            st = mpt.state(optimizer)
            out["steps"] = int(st.steps)
            out["skipped"] = int(st.skipped_steps)
            ddp = self.wrappers[0]
            group = consensus_group(optimizer._mixprec.group)
            out["consensus_is_ddp_group"] = group is ddp.process_group
            out["ddp_over_converted"] = ddp.module is self
        rank = torch.distributed.get_rank()
        path = self.out.with_name(f"{self.out.name}-rank{rank}.json")
        path.write_text(json.dumps(out))


def data() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=gen) * 3
    return TensorDataset(x, torch.randint(0, 3, (64,), generator=gen))


def fit(strategy: str, precision: Any, out: Path) -> None:
    module = Tiny(out)
    plugins = [] if isinstance(precision, str) else [precision]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **({"precision": precision} if not plugins else {"plugins": plugins}),
    )
    trainer.fit(module, DataLoader(data(), batch_size=8))


CONFIGS = ("mixprec-O1-bf16", "lightning-bf16-mixed", "mixprec-O2-bf16")


def run(strategy: str, workdir: Path, configs: tuple[str, ...] = CONFIGS) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in configs:
            kind, _, policy = name.partition("-")
            precision = MixprecPrecision(policy, log_state=False) if kind == "mixprec" else policy
            fit(strategy, precision, workdir / f"{strategy}-{name}")


if __name__ == "__main__":
    strategy, rank, workdir, port = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, GLOO_SOCKET_IFNAME="lo")
    if strategy == "ddp":
        os.environ.update(LOCAL_RANK=rank, NODE_RANK="0", WORLD_SIZE="2", RANK=rank)
    torch.set_num_threads(1)
    run(strategy, workdir, tuple(sys.argv[5].split(",")) if len(sys.argv) > 5 else CONFIGS)
