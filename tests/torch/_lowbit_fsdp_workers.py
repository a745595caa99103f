"""One rank of the low-bit-state-under-FSDP2 tests: ``python _lowbit_fsdp_workers.py SCENARIOS
RANK WORLD WORKDIR``, started by ``tests/torch/test_lowbit_fsdp.py``.

The process group, the launch and the result files are ``_dist_workers.py``'s (its ``main``,
with this file's scenarios added). Each scenario trains a model sharded by FSDP2 under a
low-bit ``state`` and checks it, rank by rank, against a reference run that does by hand what
the state promises: torch's own Adam over a plain copy of this rank's shard, fed the same
(reduced) gradient shards, its moments decoded from codes before each step and encoded after
it with the codec (:mod:`mixprec_torch.lowbit.codec`) over the unpadded shard.
"""

from __future__ import annotations

import io
import math
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

import _dist_workers as base

import mixprec.torch as mpt
from mixprec.kit import parse_state_format
from mixprec_torch.lowbit.codec import dequantize, quantize
from mixprec_torch.lowbit.shards import local
from mixprec_torch.wrapping.sharding import fully_shard_with_policy

Result = dict[str, Any]
KEYS = (("exp_avg", True), ("exp_avg_sq", False))


def make_model() -> torch.nn.Module:
    """Uneven shards on two ranks: the third Linear's 3 rows are 2 + 1 (rank 1's padded to 2),
    the last one's single row is rank 0's alone (rank 1's shards are empty, all padding)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 3),
        torch.nn.ReLU(),
        torch.nn.Linear(3, 1),
    )


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(8, 8, generator=gen), torch.randn(8, 1, generator=gen)


def build(policy: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model()
    fully_shard_with_policy(model, policy)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return mpt.wrap(model, optimizer, policy=policy)  # type: ignore[return-value]


def step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, inject_inf: bool = False
) -> list[torch.Tensor]:
    """One step; returns this rank's gradient shards as the optimizer got them."""
    x, y = batch(rank)
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    with mpt.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    if inject_inf:
        local(next(iter(model.parameters())).grad).view(-1)[0] = math.inf  # type: ignore[arg-type]
    grads = [local(p.grad).detach().clone() for p in model.parameters()]  # type: ignore[arg-type]
    optimizer.step()
    return grads


def codes_of(optimizer: torch.optim.Optimizer) -> list[Any]:
    """This rank's codes and absmax of every parameter (clones), and the tags."""
    out: list[Any] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            out.append(state["mixprec.state"])
            for key, _ in KEYS:
                out.append(local(state[key]).clone())
                out.append(local(state[key + ".absmax"]).clone())
    return out


def same(a: list[Any], b: list[Any]) -> bool:
    if len(a) != len(b):
        return False
    pairs = zip(a, b, strict=True)
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in pairs)


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[Any]:
    params = [local(p).detach().clone() for p in model.parameters()]
    steps = [optimizer.state[p]["step"].clone() for p in model.parameters()]
    st = mpt.state(optimizer)
    return [*params, *steps, *codes_of(optimizer), st.steps, st.skipped_steps, st.loss_scale]


class Reference:
    """torch's Adam over a plain copy of this rank's shards, the moments kept as codes of
    the unpadded shards between steps."""

    def __init__(self, model: torch.nn.Module, spec: str) -> None:
        self.fmt = parse_state_format(spec)
        self.params = [
            torch.nn.Parameter(local(p).detach().clone())  # type: ignore[arg-type]
            for p in model.parameters()
        ]
        self.optimizer = torch.optim.Adam(self.params, lr=1e-2)
        self.codes: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}

    def step(self, grads: list[torch.Tensor]) -> None:
        for index, (p, g) in enumerate(zip(self.params, grads, strict=True)):
            p.grad = g.clone()
            state = self.optimizer.state[p]
            for key, signed in KEYS:
                if index in self.codes:
                    codes, scale = self.codes[index][key]
                    state[key] = dequantize(codes, scale, self.fmt, signed, p.numel()).view(p.shape)
        self.optimizer.step()
        for index, p in enumerate(self.params):
            state = self.optimizer.state[p]
            self.codes[index] = {
                key: quantize(state[key].float(), self.fmt, signed) for key, signed in KEYS
            }

    def matches(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
        """This rank's weights bit for bit, its codes and absmax bit for bit (the shard's
        own, then zeros up to a whole shard's length: the padding)."""
        for index, (p, ref) in enumerate(zip(model.parameters(), self.params, strict=True)):
            if not torch.equal(local(p).detach(), ref.detach()):  # type: ignore[arg-type]
                return False
            state = optimizer.state[p]
            for key, _ in KEYS:
                codes, scale = self.codes[index][key]
                mine, mine_scale = local(state[key]), local(state[key + ".absmax"])
                for got, want in ((mine, codes), (mine_scale, scale)):
                    if not torch.equal(got[: want.numel()], want) or bool(
                        got[want.numel() :].any()
                    ):
                        return False
        return True


def full(tensors: list[torch.Tensor]) -> list[list[float]]:
    return [t.full_tensor().float().flatten().tolist() for t in tensors]  # type: ignore[attr-defined]


def lowbit_fsdp_train(rank: int, world: int) -> Result:
    """int8 and int4 (block 32, every moment quantized) under FSDP2 on O2-bf16: five steps,
    the third skipped (an inf on rank 1 alone), each compared with the reference."""
    out: Result = {}
    for spec in ("int8(block=32,min_size=0)", "int4(block=32,min_size=0)"):
        policy = f"O2-bf16,state={spec}"
        model, optimizer = build(policy)
        ref = Reference(model, spec)
        matched = []
        for i in range(5):
            before = codes_of(optimizer) if i == 2 else None
            params_before = [local(p).detach().clone() for p in model.parameters()]
            grads = step(model, optimizer, rank, inject_inf=(i == 2 and rank == 1))
            if before is not None:
                out[f"{spec}.skipped"] = bool(mpt.state(optimizer).last_step_skipped)
                out[f"{spec}.skip_kept_codes"] = same(before, codes_of(optimizer))
                out[f"{spec}.skip_kept_params"] = all(
                    torch.equal(a, local(p).detach())
                    for a, p in zip(params_before, model.parameters(), strict=True)
                )
                continue
            ref.step(grads)
            matched.append(ref.matches(model, optimizer))
        out[f"{spec}.matched"] = matched
        first = next(iter(model.parameters()))
        state = optimizer.state[first]
        out[f"{spec}.codes_are_sharded"] = [
            type(state["exp_avg"]).__name__,
            str(state["exp_avg"].dtype),
            list(state["exp_avg"].shape),
            local(state["exp_avg"]).numel(),
        ]
        out[f"{spec}.tags"] = sorted(
            {str(optimizer.state[p]["mixprec.state"]) for p in model.parameters()}
        )
        out[f"{spec}.full_params"] = full(list(model.parameters()))
        codes = [optimizer.state[p][k] for p in model.parameters() for k, _ in KEYS]
        out[f"{spec}.full_codes"] = full(codes)
        decoded = mpt.float32_state_dict(optimizer)["state"]
        out[f"{spec}.full_moments"] = full([decoded[i][k] for i in decoded for k, _ in KEYS])
        own = [
            dequantize(*ref.codes[i][k], ref.fmt, signed, p.numel()).view(p.shape)
            for i, p in enumerate(ref.params)
            for k, signed in KEYS
        ]
        mine = [local(decoded[i][k]) for i in decoded for k, _ in KEYS]
        out[f"{spec}.decoded_shards_match_reference"] = all(
            torch.equal(a, b) for a, b in zip(own, mine, strict=True)
        )
        out[f"{spec}.state_bytes"] = optimizer._mixprec.group.lowbit.state_bytes(optimizer)  # type: ignore[union-attr]
    return out


def lowbit_fsdp_checkpoint(rank: int, world: int) -> Result:
    """int8 under FSDP2: optimizer.state_dict() saved per rank (torch.save, weights_only
    load) and DCP (mixprec's get_state_dict, dcp.save, dcp.load, set_state_dict) resume
    exactly: the same weights, codes, absmax, tags and counts, and two more steps alike."""
    import torch.distributed.checkpoint as dcp

    from mixprec.torch import get_state_dict, set_state_dict

    policy = "O2-bf16,state=int8(block=32,min_size=0)"
    out: Result = {}

    # per rank: optimizer.state_dict() through torch.save / torch.load(weights_only=True)
    model, optimizer = build(policy)
    for _ in range(2):
        step(model, optimizer, rank)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    out["per_rank_codes_in_state_dict"] = str(loaded["optim"]["state"][0]["exp_avg"].dtype)
    model2, optimizer2 = build(policy)
    model2.load_state_dict(loaded["model"])
    optimizer2.load_state_dict(loaded["optim"])
    out["per_rank_resumed_equal"] = same(snapshot(model2, optimizer2), snapshot(model, optimizer))
    for _ in range(2):
        step(model, optimizer, rank)
        step(model2, optimizer2, rank)
    out["per_rank_continued_equal"] = same(snapshot(model2, optimizer2), snapshot(model, optimizer))

    # rank 1's part of the checkpoint written under another block size: both ranks refuse
    buf.seek(0)
    damaged = torch.load(buf, weights_only=True)["optim"]
    if rank == 1:
        damaged["state"][0]["mixprec.state"] = (0, 64, 2)
    before = snapshot(model2, optimizer2)
    out["one_rank_refused"] = base._raised(lambda: optimizer2.load_state_dict(damaged))
    out["one_rank_refused_unchanged"] = same(snapshot(model2, optimizer2), before)

    # DCP
    model, optimizer = build(policy)
    for _ in range(2):
        step(model, optimizer, rank)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    path = base.WORKDIR / "dcp-lowbit"
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    model2, optimizer2 = build(policy)
    model_sd2, optim_sd2 = get_state_dict(model2, optimizer2)  # the dummy step: codes
    out["dcp_template_codes"] = str(optim_sd2["state"]["0.weight"]["exp_avg"].dtype)
    out["dcp_template_steps"] = int(mpt.state(optimizer2).steps)
    state = {"model": model_sd2, "optim": optim_sd2}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model2, optimizer2, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    out["dcp_resumed_equal"] = same(snapshot(model2, optimizer2), snapshot(model, optimizer))
    for _ in range(2):
        step(model, optimizer, rank)
        step(model2, optimizer2, rank)
    out["dcp_continued_equal"] = same(snapshot(model2, optimizer2), snapshot(model, optimizer))
    out["dcp_steps"] = int(mpt.state(optimizer2).steps)
    return out


def lowbit_fsdp_nonfinite(rank: int, world: int) -> Result:
    """Rank 1 alone overflows its moments (its beta2 set to inf, as a diverging update
    would): every rank refuses the step (PolicyError) and keeps its codes."""
    model, optimizer = build("O2-bf16,state=int8(block=32,min_size=0)")
    step(model, optimizer, rank)
    before = codes_of(optimizer)
    x, y = batch(rank)
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    with mpt.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    if rank == 1:
        optimizer.param_groups[0]["betas"] = (0.9, math.inf)  # v * beta2 overflows
    raised = base._raised(optimizer.step)
    return {"raised": raised, "codes_kept": same(before, codes_of(optimizer))}


base.SCENARIOS.update(
    {
        "lowbit_fsdp_train": lowbit_fsdp_train,
        "lowbit_fsdp_checkpoint": lowbit_fsdp_checkpoint,
        "lowbit_fsdp_nonfinite": lowbit_fsdp_nonfinite,
    }
)

if __name__ == "__main__":
    import os

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sys.exit(base.main(sys.argv[1:]))
