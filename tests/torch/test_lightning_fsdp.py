"""Lightning's FSDP with MixprecPrecision (issue 37, item 3).

FSDP2 works through Lightning's ``ModelParallelStrategy(data_parallel_size=2,
tensor_parallel_size=1)`` on two CPU processes (gloo): the module shards itself in
``configure_model`` (a plain ``fully_shard``, or the plugin's ``fully_shard`` with its policy)
and trains bit for bit as under Lightning's own ``bf16-mixed``; checkpoints (DCP folders and
single files) resume exactly. Lightning's ``FSDPStrategy`` (FSDP1) takes only its own
``FSDPPrecision`` (and a GPU): refused by Lightning, the recipe is in the docs and in the
plugin's own refusal of a wrapped module.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

import lightning as L  # noqa: E402
from _lightning_nets import LIGHTNING_MARKS  # noqa: E402
from _ranks import multi_rank  # noqa: E402
from lightning.pytorch.strategies import FSDPStrategy  # noqa: E402
from torch import nn  # noqa: E402

from mixprec.errors import WrapError  # noqa: E402
from mixprec.lightning import MixprecPrecision  # noqa: E402

pytestmark = LIGHTNING_MARKS

WORKER = Path(__file__).with_name("_lightning_fsdp_worker.py")
#: the marks of a test that starts two Lightning processes
two_ranks = multi_rank(240)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _results(workdir: Path, configs: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Run ``configs`` on two ranks; each config's result (or refusal) by rank, rank 0 first."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MIXPREC_DISABLE_PLUGINS="mxnet")
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), rank, str(workdir), port, ",".join(configs)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        for rank in ("0", "1")
    ]
    try:
        logs = [p.communicate(timeout=200)[0].decode(errors="replace") for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    out: dict[str, list[dict[str, Any]]] = {}
    for name in configs:
        ranks = []
        for r in (0, 1):
            done, refused = (workdir / f"{name}-rank{r}{s}.json" for s in ("", "-error"))
            if not (done.exists() or refused.exists()):
                pytest.fail(f"{name} did not finish:\n" + "\n".join(s[-3000:] for s in logs))
            ranks.append(json.loads((done if done.exists() else refused).read_text()))
        out[name] = ranks
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 0, log[-3000:]
    return out


@two_ranks
def test_fsdp2_with_the_plugin_matches_lightnings_bf16_mixed(tmp_path: Path) -> None:
    configs = [
        "lightning-bf16-mixed",
        "mixprec-O1-bf16-plain",
        "mixprec-O1-bf16",
        "mixprec-O2-bf16",
        "mixprec-O2-bf16-plain",
        "mixprec-auto",
    ]
    clipped = ["lightning-bf16-mixed-clip-validate"]
    clipped += [f"mixprec-{p}-clip-validate" for p in ("O1-bf16", "O2-bf16")]
    got = _results(tmp_path, configs + clipped)
    theirs = got["lightning-bf16-mixed"]
    assert theirs[0]["params"] == theirs[1]["params"] and theirs[0]["sharded"]
    assert theirs[0]["losses"] != theirs[1]["losses"]  # each rank saw its own data
    for name in ("mixprec-O1-bf16-plain", "mixprec-O1-bf16", "mixprec-O2-bf16"):
        for r, (mine, lightning) in enumerate(zip(got[name], theirs, strict=True)):
            # O1-bf16 is autocast's casting; O2-bf16 over FSDP2 gathers bfloat16 weights for
            # the same linear kernels and reduces float32 gradients into float32 shards
            assert mine["losses"] == lightning["losses"], f"{name} rank {r}"
            assert mine["params"] == lightning["params"], f"{name} rank {r}"
            assert mine["dtypes"] == ["torch.float32"] and mine["sharded"]  # the shards: masters
            assert mine["steps"] == 4 and mine["skipped"] == 0 and mine["global_step"] == 4
            assert mine["consensus_is_mesh_group"]  # skips agreed over FSDP's mesh
            assert mine["precision"] == "bf16-mixed"
    # gradient_clip_val clips the same float32 gradients; validate after fit reuses the wrap
    for name in clipped[1:]:
        for r, (mine, lightning) in enumerate(zip(got[name], got[clipped[0]], strict=True)):
            assert mine["losses"] == lightning["losses"], f"{name} rank {r}"
            assert mine["params"] == lightning["params"], f"{name} rank {r}"
            assert mine["val_loss"] == lightning["val_loss"], f"{name} rank {r}"
            assert mine["params"] != theirs[r]["params"]  # the clipping did something
    for refused in got["mixprec-O2-bf16-plain"]:  # a plain fully_shard computes in float32
        assert refused["type"] == "WrapError"
        assert "FSDP computes in float32" in refused["message"]
        assert "self.trainer.precision_plugin.fully_shard(module" in refused["message"]
    for auto in got["mixprec-auto"]:  # resolved by the plugin's fully_shard, kept by wrap
        assert auto["plugin_policy"] == auto["policy"] != "auto"
        assert auto["steps"] == 4
    assert got["mixprec-auto"][0]["params"] == got["mixprec-auto"][1]["params"]


@two_ranks
def test_fsdp2_checkpoints_resume_exactly(tmp_path: Path) -> None:
    pairs = [
        ("mixprec-O2-bf16-adam-full", "mixprec-O2-bf16-adam-save"),
        ("mixprec-O2-bf16-adam-full", "mixprec-O2-bf16-adam-file-save"),
        ("mixprec-O1-adam-grow-full", "mixprec-O1-adam-grow-save"),
    ]
    configs = list(dict.fromkeys(name for pair in pairs for name in pair))
    got = _results(tmp_path, configs)
    assert (tmp_path / "mixprec-O2-bf16-adam-save.ckpt").is_dir()  # DCP: a folder of shards
    assert (tmp_path / "mixprec-O2-bf16-adam-file-save.ckpt").is_file()
    for full_name, resumed_name in pairs:
        for r, (full, resumed) in enumerate(zip(got[full_name], got[resumed_name], strict=True)):
            where = f"{resumed_name} rank {r}"
            assert "message" not in resumed, resumed
            assert resumed["losses"] == full["losses"][2:], where  # the second epoch
            assert resumed["params"] == full["params"], where
            assert resumed["steps"] == full["steps"] == 4, where
            assert resumed["loss_scale"] == full["loss_scale"], where
    # float16 with a scale that doubles each step: 1024 -> 4096 at the save, 16384 at the end
    assert [r["loss_scale"] for r in got["mixprec-O1-adam-grow-save"]] == [16384.0, 16384.0]


# --------------------------------------------------------------------------------------------
# Lightning's FSDPStrategy (FSDP1): refused, with the recipe


def test_lightnings_fsdp_strategy_refuses_the_plugin() -> None:
    """On the CPU Lightning refuses FSDPStrategy itself; on a GPU it refuses any precision
    plugin but its own FSDPPrecision when the Trainer is built (before mixprec sees the
    module). Both are Lightning's errors; the guide names the FSDP2 recipe."""
    plugin = MixprecPrecision("O2-bf16")
    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        L.Trainer(accelerator="cpu", devices=2, strategy="fsdp", plugins=[plugin])
    strategy = FSDPStrategy()
    with pytest.raises(TypeError, match=r"FSDPPrecision.*MixprecPrecision\('O2-bf16'\)"):
        strategy.precision_plugin = plugin


def test_a_module_the_strategy_wrapped_is_refused_with_the_fsdp2_recipe() -> None:
    """A strategy that wraps the module (FSDP1's FullyShardedDataParallel, any other wrapper
    than DDP) before connect: refused, naming ModelParallelStrategy and the plugin's
    fully_shard; nothing is converted."""
    wrapped = nn.Sequential(nn.Linear(4, 4))
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    with pytest.raises(WrapError, match="already wrapped in Sequential") as refused:
        MixprecPrecision("O2-bf16").connect(wrapped, [optimizer], [])
    message = str(refused.value)
    assert "ModelParallelStrategy(data_parallel_size=" in message
    assert "self.trainer.precision_plugin.fully_shard(self.net" in message
    assert "FSDPStrategy" in message and "FSDP1" in message
    assert wrapped[0].weight.dtype == torch.float32 and not hasattr(optimizer, "_mixprec")
