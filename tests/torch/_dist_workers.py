"""One rank of the distributed tests: ``python _dist_workers.py SCENARIOS RANK WORLD WORKDIR``.

Started by ``tests/torch/test_distributed.py``, one process per rank. Rank 0 opens a
``TCPStore`` on 127.0.0.1 with a port the OS picks and publishes the port in ``WORKDIR``;
the other ranks read it from there (no port race). Every rank joins a gloo process group,
runs the scenarios (comma-separated names), writes ``WORKDIR/rank<RANK>.json`` and destroys
the group. The test process compares the ranks' results. One launch serves all the tests:
starting a rank (importing torch) costs more than the scenarios themselves.
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import mixprec.torch as mpt
from mixprec_torch.wrapping.sharding import fully_shard_with_policy, register_ddp_reduce_hook

TIMEOUT = datetime.timedelta(seconds=30)
Result = dict[str, Any]


# --------------------------------------------------------------------------------------------
# process group


def _store(rank: int, world: int, workdir: Path) -> dist.TCPStore:
    port_file = workdir / "port"
    if rank == 0:
        store = dist.TCPStore(
            "127.0.0.1", 0, world, is_master=True, timeout=TIMEOUT, wait_for_workers=False
        )
        tmp = workdir / "port.tmp"
        tmp.write_text(str(store.port))
        tmp.rename(port_file)  # atomic: readers never see a half-written port
        return store
    deadline = time.monotonic() + TIMEOUT.total_seconds()
    while not port_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("rank 0 never published its store port")
        time.sleep(0.02)
    port = int(port_file.read_text())
    return dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=TIMEOUT)


# --------------------------------------------------------------------------------------------
# shared pieces


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.BatchNorm1d(16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 4),
    )


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    return torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)


def values(tensors: list[torch.Tensor]) -> list[list[float]]:
    from mixprec_torch.wrapping.sharding import local_tensor

    return [local_tensor(t).detach().float().flatten().tolist() for t in tensors]


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    inject_inf: bool = False,
) -> float:
    """One user-style step; ``inject_inf`` puts an inf into this rank's first gradient after
    the gradient reduction, so only this rank can see it."""
    from mixprec_torch.wrapping.sharding import local_tensor

    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    with mpt.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    if inject_inf:
        grad = next(p.grad for p in model.parameters() if p.grad is not None)
        local_tensor(grad).view(-1)[0] = math.inf
    optimizer.step()
    return loss.detach().item()


def state_of(optimizer: torch.optim.Optimizer) -> Result:
    st = mpt.state(optimizer)
    return {
        "loss_scale": float(st.loss_scale),
        "skipped_steps": int(st.skipped_steps),
        "last_step_skipped": bool(st.last_step_skipped),
    }


# --------------------------------------------------------------------------------------------
# scenarios


def ddp_skip(rank: int, world: int) -> Result:
    """O2 float16 under DDP; rank 1 alone sees an inf at step 1: every rank must skip it."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = mpt.wrap(model, optimizer, policy="O2")
    ddp = DistributedDataParallel(model)
    x, y = batch(rank)
    out: Result = {"scale_init": state_of(optimizer)["loss_scale"]}
    train_step(ddp, optimizer, x, y)
    out["after_first"] = state_of(optimizer)
    before_params = values(list(model.parameters()))
    before_masters = values(list(mpt.master_params(optimizer)))
    train_step(ddp, optimizer, x, y, inject_inf=rank == 1)
    out["after_inf"] = state_of(optimizer)
    out["unchanged_by_skip"] = values(list(model.parameters())) == before_params and (
        values(list(mpt.master_params(optimizer))) == before_masters
    )
    out["params_after_skip"] = values(list(model.parameters()))
    for _ in range(2):
        train_step(ddp, optimizer, x, y)
    out["final"] = state_of(optimizer)
    out["params_final"] = values(list(model.parameters()))
    out["masters_final"] = values(list(mpt.master_params(optimizer)))
    return out


def ddp_bf16(rank: int, world: int) -> Result:
    """O2-bf16 (reducing in policy.reduce through the comm hook), O1-bf16 and the
    compensated O3-bf16-kahan and O3-bf16-sr (same seed on every rank; the last also with
    the optimizer state rounded into bfloat16) under DDP."""
    out: Result = {}
    runs = (
        ("O2-bf16", True),
        ("O1-bf16", False),
        ("O3-bf16-kahan", True),
        ("O3-bf16-sr", True),
        ("O3-bf16-sr,state=bfloat16", True),
        ("O2-bf16,state=int8(min_size=0)", True),  # every moment quantized on each rank
    )
    for policy, hook in runs:
        model = make_model()
        initial = values(list(model.parameters()))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        model, optimizer = mpt.wrap(model, optimizer, policy=policy)
        ddp = DistributedDataParallel(model)
        if hook:
            register_ddp_reduce_hook(ddp, policy)
        x, y = batch(rank)
        losses = [train_step(ddp, optimizer, x, y) for _ in range(4)]
        params = values(list(model.parameters()))
        out[policy] = {
            "losses": losses,
            "params": params,
            "moved": params != initial,
            "param_dtypes": [str(p.dtype) for p in model.parameters()],
            "state": state_of(optimizer),
            "moment_dtypes": sorted(
                {
                    str(v.dtype)
                    for s in optimizer.state.values()
                    for k, v in s.items()
                    if k == "exp_avg"
                }
            ),
        }
    return out


def record_dtypes(model: torch.nn.Module) -> dict[str, str]:
    """Record the input and output dtype of the first Linear, the BatchNorm and the head."""
    seen: dict[str, str] = {}

    def record(name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            seen[f"{name}.in"] = str(args[0].dtype)
            seen[f"{name}.out"] = str(output.dtype)

        return hook

    for name, module in (("linear", model[0]), ("bn", model[1]), ("head", model[3])):
        module.register_forward_hook(record(name))
    return seen


def full_params(model: torch.nn.Module) -> list[list[float]]:
    """Every parameter gathered from its shards: the model every rank must agree on."""
    return [
        p.full_tensor().float().flatten().tolist()  # type: ignore[attr-defined]
        for p in model.parameters()
    ]


def fsdp_bf16(rank: int, world: int) -> Result:
    """FSDP2 on CPU under O2-bf16 with the BatchNorm pinned to float32; rank 1 alone sees an
    inf in its gradient shard at step 1: every rank must skip it."""
    from torch.distributed.fsdp import FSDPModule

    model = make_model()
    seen = record_dtypes(model)
    fully_shard_with_policy(model, "O2-bf16")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = mpt.wrap(model, optimizer, policy="O2-bf16")
    x, y = batch(rank)
    out: Result = {
        "bn_sharded_separately": isinstance(model[1], FSDPModule),
        "shard_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "masters_are_params": all(
            m is p for m, p in zip(mpt.master_params(optimizer), model.parameters(), strict=True)
        ),
    }
    train_step(model, optimizer, x, y)
    out["dtypes_seen"] = dict(seen)
    before = values(list(model.parameters()))
    train_step(model, optimizer, x, y, inject_inf=rank == 1)
    out["after_inf"] = state_of(optimizer)
    out["unchanged_by_skip"] = values(list(model.parameters())) == before
    for _ in range(2):
        train_step(model, optimizer, x, y)
    out["final"] = state_of(optimizer)
    out["moved_after_skip"] = values(list(model.parameters())) != before
    out["full_params"] = full_params(model)
    return out


def fsdp_o1_bf16(rank: int, world: int) -> Result:
    """FSDP2 under O1-bf16: FSDP only shards (float32 everywhere), mixprec casts per op."""
    from torch.distributed.fsdp import FSDPModule

    model = make_model()
    seen = record_dtypes(model)
    fully_shard_with_policy(model, "O1-bf16")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = mpt.wrap(model, optimizer, policy="O1-bf16")
    x, y = batch(rank)
    before = full_params(model)
    losses = [train_step(model, optimizer, x, y) for _ in range(3)]
    return {
        "bn_sharded_separately": isinstance(model[1], FSDPModule),
        "shard_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "dtypes_seen": dict(seen),
        "losses": losses,
        "state": state_of(optimizer),
        "moved": full_params(model) != before,
        "full_params": full_params(model),
    }


STALL_WAIT = 2.0
WORKDIR = Path(".")  # main() sets the launch's folder: the stalled scenario signals through it


def stalled_peer(rank: int, world: int) -> Result:
    """Rank 1 fails but stays alive (it skips optimizer.step() and sleeps); rank 0 must get a
    DistributedError from the overflow all-reduce after STALL_WAIT seconds, not hang until the
    process group's timeout. Rank 1 then joins late, so the pending collective completes and
    the group shuts down cleanly (it waits for rank 0's signal file, not for a fixed time, so
    a loaded machine cannot make it join before rank 0 gave up)."""
    from mixprec_torch.step.distributed import set_overflow_timeout

    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mpt.wrap(model, opt, policy="O2", loss_scale="dynamic")
    x, y = batch(rank)
    result: Result = {}
    if rank == 0:
        set_overflow_timeout(STALL_WAIT)
        start = time.monotonic()
        try:
            train_step(model, opt, x, y)
        except Exception as err:  # what the user sees, recorded for the test process
            result["raised"] = f"{type(err).__module__}.{type(err).__name__}: {err}"
        result["waited"] = time.monotonic() - start
        result["scaler_steps"] = int(mpt.state(opt).steps)
        set_overflow_timeout(None)
        (WORKDIR / "stalled.done").write_text("done")
    else:
        deadline = time.monotonic() + TIMEOUT.total_seconds()
        while not (WORKDIR / "stalled.done").exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # "failed but alive": no optimizer.step() for a while
        dist.all_reduce(torch.zeros(1), op=dist.ReduceOp.MAX)  # joins late, freeing rank 0
    dist.barrier()
    return result


# --------------------------------------------------------------------------------------------
# scale-out (issue 37): FSDP after wrap, a user's FSDP2 mixed precision, DCP, process groups


def _raised(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return ""


def _one_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    x, y = batch(rank)
    train_step(model, optimizer, x, y)


def fsdp_after_wrap(rank: int, world: int) -> Result:
    """wrap, then a plain fully_shard (or FSDP1 with use_orig_params=True): the first step
    refuses instead of training nothing; FSDP1 before wrap names the FSDP2 recipe."""
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    def plain() -> torch.nn.Module:
        torch.manual_seed(0)  # no BatchNorm: FSDP shards one dtype only
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    out: Result = {}
    model = plain()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = mpt.wrap(model, optimizer, policy="O2-bf16")
    fully_shard(model)
    masters = values(list(mpt.master_params(optimizer)))
    out["fully_shard"] = _raised(lambda: _one_step(model, optimizer, rank))
    out["fully_shard_masters_unchanged"] = values(list(mpt.master_params(optimizer))) == masters
    out["fully_shard_steps"] = int(mpt.state(optimizer).steps)

    model = plain()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = mpt.wrap(model, optimizer, policy="O2-bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP1's deprecation
        fsdp1 = FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"))
    out["fsdp1_after"] = _raised(lambda: _one_step(fsdp1, optimizer, rank))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fsdp1 = FullyShardedDataParallel(make_model(), device_id=torch.device("cpu"))
    opt1 = torch.optim.SGD(fsdp1.parameters(), lr=0.1)
    out["fsdp1_before"] = _raised(lambda: mpt.wrap(fsdp1, opt1, policy="O2-bf16"))
    return out


def fsdp_user_mp(rank: int, world: int) -> Result:
    """A user's own fully_shard(mp_policy=...) is read: float16 under O2-bf16 is refused,
    bfloat16 under O2-bf16 trains (over the FSDP mesh's group)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from mixprec_torch.step.distributed import consensus_group

    out: Result = {}
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out["float16"] = _raised(lambda: mpt.wrap(model, optimizer, policy="O2-bf16"))
    out["float16_not_wrapped"] = not hasattr(optimizer, "_mixprec")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = mpt.wrap(model, optimizer, policy="O2-bf16")
    before = full_params(model)
    _one_step(model, optimizer, rank)
    out["bfloat16_moved"] = full_params(model) != before
    mesh = next(iter(model.parameters())).device_mesh
    out["consensus_is_mesh_group"] = consensus_group(optimizer._mixprec.group) is mesh.get_group()
    return out


def dcp_resume(rank: int, world: int) -> Result:
    """DCP under DDP (O2, float16) and FSDP2 (O2-bf16 and O2): two
    steps, get_state_dict + dcp.save, a fresh model loads it (dcp.load + set_state_dict),
    both train two more steps: the same numbers. torch's own set_state_dict on FSDP2 runs its
    dummy step without a StepOrderError and without counting it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict as torch_get_state_dict

    from mixprec.torch import get_state_dict, set_state_dict

    def build(kind: str, policy: str) -> tuple[Any, Any, Any]:
        model = make_model()
        if kind == "fsdp":
            fully_shard_with_policy(model, policy)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        model, optimizer = mpt.wrap(model, optimizer, policy=policy)
        runner = DistributedDataParallel(model) if kind == "ddp" else model
        return model, optimizer, runner

    def snapshot(model: Any, optimizer: Any, kind: str) -> Any:
        params = full_params(model) if kind == "fsdp" else values(list(model.parameters()))
        masters = [
            (m.full_tensor() if kind == "fsdp" else m).detach().float().flatten().tolist()
            for m in mpt.master_params(optimizer)
        ]
        return params, masters, state_of(optimizer), int(mpt.state(optimizer).steps)

    out: Result = {}
    x, y = batch(rank)
    for kind, policy in (("ddp", "O2"), ("fsdp", "O2-bf16"), ("fsdp", "O2")):
        name = f"{kind}-{policy}"
        model, optimizer, runner = build(kind, policy)
        for _ in range(2):
            train_step(runner, optimizer, x, y)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        path = WORKDIR / f"dcp-{name}"
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
        model2, optimizer2, runner2 = build(kind, policy)
        model_sd2, optim_sd2 = get_state_dict(model2, optimizer2)  # the dummy step: not counted
        steps_after_template = int(mpt.state(optimizer2).steps)
        loaded = {"model": model_sd2, "optim": optim_sd2}
        dcp.load(loaded, checkpoint_id=str(path))
        set_state_dict(
            model2, optimizer2, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
        )
        resumed = snapshot(model2, optimizer2, kind) == snapshot(model, optimizer, kind)
        for _ in range(2):
            train_step(runner, optimizer, x, y)
            train_step(runner2, optimizer2, x, y)
        out[name] = {
            "template_steps": steps_after_template,
            "has_mixprec_entry": "mixprec" in optim_sd,
            "resumed_equal": resumed,
            "continued_equal": snapshot(model2, optimizer2, kind)
            == snapshot(model, optimizer, kind),
            "steps": int(mpt.state(optimizer2).steps),
        }
    # torch's own function on FSDP2 (the optimizer's params are the model's): its dummy step
    model, optimizer, _ = build("fsdp", "O2")
    out["torch_fsdp_dummy_step"] = _raised(lambda: torch_get_state_dict(model, optimizer))
    out["torch_fsdp_dummy_counted"] = int(mpt.state(optimizer).steps)
    return out


def process_groups(rank: int, world: int) -> Result:
    """The overflow consensus runs where the gradients are reduced: a model only rank 0 trains
    (process_group="local") makes no collective; DDP over a subgroup reduces over it; an
    explicit group is used as given."""
    from mixprec_torch.step.distributed import consensus_group

    out: Result = {}
    if rank == 0:  # a probe trained on rank 0 only: with WORLD, gloo aborts on a mismatch
        probe = torch.nn.Linear(8, 4)
        popt = torch.optim.SGD(probe.parameters(), lr=0.1)
        probe, popt = mpt.wrap(probe, popt, policy="O2", process_group="local")
        x, y = batch(rank)
        for _ in range(3):
            train_step(probe, popt, x, y)
        out["local_steps"] = int(mpt.state(popt).steps)
    sub = dist.new_group(ranks=list(range(world)))
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = mpt.wrap(model, optimizer, policy="O2")
    ddp = DistributedDataParallel(model, process_group=sub)
    x, y = batch(rank)
    train_step(ddp, optimizer, x, y)
    out["ddp_subgroup"] = consensus_group(optimizer._mixprec.group) is sub
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = mpt.wrap(model, optimizer, policy="O2", process_group=sub)
    train_step(DistributedDataParallel(model, process_group=sub), optimizer, x, y)
    out["explicit"] = consensus_group(optimizer._mixprec.group) is sub
    out["bad"] = _raised(lambda: mpt.wrap(torch.nn.Linear(2, 2), policy="O2", process_group="x"))
    dist.barrier()  # every rank still makes the same collective calls
    return out


def ddp_timeout(rank: int, world: int) -> Result:
    """Rank 1 fails before backward (it stays alive and never reaches DDP's all-reduce): rank 0,
    in DDP's gradient all-reduce over a group made with process_group_timeout(), fails after
    MIXPREC_OVERFLOW_TIMEOUT seconds, not torch's 30 minutes."""
    from mixprec_torch.step.distributed import process_group_timeout, set_overflow_timeout

    set_overflow_timeout(STALL_WAIT)
    group = dist.new_group(ranks=list(range(world)), timeout=process_group_timeout())
    set_overflow_timeout(None)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = mpt.wrap(model, optimizer, policy="O2")
    ddp = DistributedDataParallel(model, process_group=group)
    x, y = batch(rank)
    result: Result = {}
    if rank == 0:
        start = time.monotonic()
        result["raised"] = _raised(lambda: train_step(ddp, optimizer, x, y))
        result["waited"] = time.monotonic() - start
        (WORKDIR / "timeout.done").write_text("done")
    else:
        deadline = time.monotonic() + TIMEOUT.total_seconds()
        while not (WORKDIR / "timeout.done").exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # "failed before backward": never joins DDP's all-reduce
    dist.barrier()  # on the default group, which is untouched
    return result


SCENARIOS: dict[str, Callable[[int, int], Result]] = {
    "fsdp_after_wrap": fsdp_after_wrap,
    "fsdp_user_mp": fsdp_user_mp,
    "dcp_resume": dcp_resume,
    "process_groups": process_groups,
    "ddp_timeout": ddp_timeout,
    "stalled_peer": stalled_peer,
    "ddp_skip": ddp_skip,
    "ddp_bf16": ddp_bf16,
    "fsdp_bf16": fsdp_bf16,
    "fsdp_o1_bf16": fsdp_o1_bf16,
}


def main(argv: list[str]) -> int:
    """Run the comma-separated scenarios in order in one process group; record each one's
    result, warnings, or traceback. After a failure the rest are not run: the other ranks may
    be stuck in a collective this rank will never join."""
    global WORKDIR
    names, rank, world, workdir = argv[0].split(","), int(argv[1]), int(argv[2]), Path(argv[3])
    WORKDIR = workdir
    torch.set_num_threads(1)
    store = _store(rank, world, workdir)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    results: dict[str, Result] = {}
    try:
        for name in names:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    result = SCENARIOS[name](rank, world)
                except Exception:
                    results[name] = {"error": traceback.format_exc()}
                    break
            result["warnings"] = [
                f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught
            ]
            results[name] = result
    finally:
        (workdir / f"rank{rank}.json").write_text(json.dumps(results))
        # DDP and FSDP modules sit in reference cycles that keep the process group alive past
        # destroy_process_group(); torch 2.13 then tears gloo down during interpreter exit and
        # aborts ("terminate called without an active exception") about one run in six.
        gc.collect()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sys.exit(main(sys.argv[1:]))
