"""One process of the Lightning FSDP2 tests (``test_lightning_fsdp.py``).

``python _lightning_fsdp_worker.py RANK WORKDIR PORT CONFIGS``: one of two processes the test
starts itself, with the variables of Lightning's own launcher (``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``), so Lightning's real ``Trainer(accelerator="cpu", devices=2,
strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))`` joins them.
The module shards itself in ``configure_model`` with FSDP2's ``fully_shard`` over the
strategy's data-parallel mesh, as Lightning's FSDP2 recipe says.

Each config is ``<precision>-<policy>[-<how>]``:

- ``lightning-bf16-mixed``: Lightning's own precision, a plain ``fully_shard``;
- ``mixprec-O1-bf16``: ``MixprecPrecision("O1-bf16")``, the same plain ``fully_shard``;
- ``mixprec-<policy>``: ``MixprecPrecision(policy)``, sharded by the plugin's ``fully_shard``
  (``mixprec.torch.fully_shard_with_policy`` with the plugin's policy, ``auto`` resolved);
- ``mixprec-<policy>-plain``: the same plugin over a plain ``fully_shard`` (under O2-bf16
  ``fit`` refuses it);
- tags: ``adam`` (Adam instead of SGD), ``clip`` (``gradient_clip_val=0.5``), ``validate``
  (``trainer.validate`` after ``fit``: ``val_loss`` joins the results), ``grow`` (a dynamic
  loss scale that doubles at every step), ``save`` (one epoch of 2 steps, a checkpoint, then
  a second epoch resumed from it by a fresh Trainer and module), ``full`` (the same 2 epochs
  uninterrupted), ``file`` (the strategy's single-file checkpoint,
  ``save_distributed_checkpoint=False``).

Each rank writes ``WORKDIR/<config>-rank<RANK>.json`` (or ``...-error.json`` with a refusal).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils.data import DataLoader, TensorDataset

import mixprec
import mixprec.torch as mpt
from mixprec.errors import MixprecError
from mixprec.lightning import MixprecPrecision

EPOCHS = 2  # 4 steps


class Tiny(L.LightningModule):
    def __init__(self, out: Path, shard: str, optimizer: str = "sgd") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        self.losses: list[float] = []
        self.out = out
        self.shard = shard
        self.optimizer_name = optimizer

    def configure_model(self) -> None:
        if isinstance(self.net, FSDPModule):  # Lightning calls it again for validate/test
            return
        mesh = self.device_mesh["data_parallel"]
        if self.shard == "plugin":  # the plugin's policy: mixprec.torch.fully_shard_with_policy
            self.trainer.precision_plugin.fully_shard(self.net, blocks=[self.net[0]], mesh=mesh)
        else:
            fully_shard(self.net[0], mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: Any, index: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x).float(), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=1e-2)
        return torch.optim.SGD(self.parameters(), lr=0.2)

    def on_train_end(self) -> None:
        """In every rank, before the strategy's teardown."""
        full = {
            name: p.full_tensor().detach().float().flatten().tolist()
            for name, p in self.named_parameters()
        }
        out: dict[str, Any] = {
            "losses": self.losses,
            "params": [full[name] for name in sorted(full)],
            "dtypes": sorted({str(p.dtype) for p in self.parameters()}),
            "sharded": all(type(p).__name__ == "DTensor" for p in self.parameters()),
            "global_step": self.trainer.global_step,
        }
        optimizer = self.trainer.optimizers[0]
        if hasattr(optimizer, "_mixprec"):
            from mixprec_torch.step.distributed import consensus_group

            st = mpt.state(optimizer)
            out["steps"] = int(st.steps)
            out["skipped"] = int(st.skipped_steps)
            out["loss_scale"] = float(st.loss_scale)
            group = consensus_group(optimizer._mixprec.group)
            out["consensus_is_mesh_group"] = group is self.device_mesh["data_parallel"].get_group()
            plugin = self.trainer.precision_plugin
            out["policy"] = str(optimizer._mixprec.group.policy)
            out["plugin_policy"] = str(plugin.policy)
            out["precision"] = plugin.precision
        rank = torch.distributed.get_rank()
        path = self.out.with_name(f"{self.out.name}-rank{rank}.json")
        path.write_text(json.dumps(out))


def data() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=gen) * 3
    return TensorDataset(x, torch.randint(0, 3, (64,), generator=gen))


def trainer(precision: Any, epochs: int, one_file: bool = False, clip: float = 0.0) -> L.Trainer:
    """Lightning's FSDP2 recipe on 2 CPU processes; each epoch is 2 steps (a checkpoint at an
    epoch's end resumes at the next batch: Lightning restarts a mid-epoch one at batch 0)."""
    plugins = [] if isinstance(precision, str) else [precision]
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=not one_file
        ),
        max_epochs=epochs,
        limit_train_batches=2,
        limit_val_batches=2,
        gradient_clip_val=clip or None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **({"precision": precision} if not plugins else {"plugins": plugins}),
    )


def plugin_or_name(kind: str, policy: str, how: set[str]) -> Any:
    if kind != "mixprec":
        return policy
    # "grow": the scale doubles at every step, so a resume that lost it would show
    grow = {"loss_scale": mixprec.DynamicScale(init=1024.0, interval=1)} if "grow" in how else {}
    return MixprecPrecision(policy, log_state=False, **grow)


def run_one(name: str, workdir: Path) -> None:
    out = workdir / name
    parts = name.split("-")
    tags = {"plain", "save", "full", "adam", "grow", "file", "clip", "validate"}
    kind, policy = parts[0], "-".join(p for p in parts[1:] if p not in tags)
    how = set(parts[1:]) & tags
    shard = "plugin" if kind == "mixprec" and "plain" not in how else "plain"
    optimizer = "adam" if "adam" in how else "sgd"
    loader = DataLoader(data(), batch_size=8)
    one_file = "file" in how
    try:
        if "save" in how:
            ckpt = workdir / f"{name}.ckpt"
            first = trainer(plugin_or_name(kind, policy, how), EPOCHS // 2, one_file)
            first.fit(Tiny(out.with_name(f"{name}-first"), shard, optimizer), loader)
            first.save_checkpoint(ckpt)
            second = trainer(plugin_or_name(kind, policy, how), EPOCHS, one_file)
            second.fit(Tiny(out, shard, optimizer), loader, ckpt_path=ckpt)
        else:
            module = Tiny(out, shard, optimizer)
            fit = trainer(plugin_or_name(kind, policy, how), EPOCHS, clip=0.5 * ("clip" in how))
            fit.fit(module, loader)
            if "validate" in how:  # the same Trainer and module: the plugin keeps its wrap
                (metrics,) = fit.validate(module, loader, verbose=False)
                rank = torch.distributed.get_rank()
                path = out.with_name(f"{name}-rank{rank}.json")
                path.write_text(json.dumps({**json.loads(path.read_text()), **metrics}))
    except MixprecError as err:  # a refusal, written for the test; anything else fails the run
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else -1
        error = {"type": type(err).__name__, "message": str(err)}
        out.with_name(f"{name}-rank{rank}-error.json").write_text(json.dumps(error))


if __name__ == "__main__":
    rank, workdir, port = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, GLOO_SOCKET_IFNAME="lo")
    os.environ.update(LOCAL_RANK=rank, NODE_RANK="0", WORLD_SIZE="2", RANK=rank)
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for config in sys.argv[4].split(","):
            run_one(config, workdir)
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
