"""Distributed behaviour of the torch backend: DDP and FSDP2 ranks skip and train together.

The multi-rank tests start two real processes (``_dist_workers.py``) that join a gloo process
group on 127.0.0.1 and compare what each rank saw. The in-process tests check the helpers'
single-process behaviour.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from _ranks import launch, multi_rank, needs_gloo, scenario  # noqa: E402

import mixprec  # noqa: E402
import mixprec.torch  # noqa: E402
from mixprec_torch.step.distributed import all_reduce_found_inf, is_distributed  # noqa: E402
from mixprec_torch.wrapping.sharding import (  # noqa: E402
    fsdp_mixed_precision_policy,
    fsdp_policy_of,
    fully_shard_with_policy,
    is_fsdp_managed,
    local_tensor,
)

pytestmark = pytest.mark.torch

WORKER = Path(__file__).with_name("_dist_workers.py")
WORLD = 2
#: the marks of a test that runs in the shared two-process gloo launch
two_ranks = multi_rank(150)


def run_ranks(scenarios: list[str], workdir: Path, timeout: float = 120.0) -> list[dict[str, Any]]:
    """Run ``scenarios`` on WORLD processes; each rank's results by scenario, rank 0 first."""
    return launch(WORKER, scenarios, workdir, WORLD, timeout)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """All scenarios, run once by WORLD ranks that share one process group."""
    return run_ranks(
        ["ddp_skip", "ddp_bf16", "fsdp_bf16", "fsdp_o1_bf16"], tmp_path_factory.mktemp("ranks")
    )


# --------------------------------------------------------------------------------------------
# two ranks


@pytest.mark.timeout(150)
@pytest.mark.slow
@pytest.mark.distributed
@needs_gloo
def test_a_stalled_peer_fails_the_overflow_check_in_bounded_time(tmp_path: Path) -> None:
    """Its own launch: the stalled collective must not disturb the shared scenarios."""
    r0, r1 = (by_name["stalled_peer"] for by_name in run_ranks(["stalled_peer"], tmp_path))
    assert r1 == {"warnings": []}
    assert r0["raised"].startswith("mixprec.errors.DistributedError: ")
    for words in ("overflow check", "rank 0 of 2", "step 0", "other ranks' logs",
                  "MIXPREC_OVERFLOW_TIMEOUT"):  # fmt: skip
        assert words in r0["raised"]
    # STALL_WAIT is 2 s (slack for a loaded machine); the process group's timeout is 30 s
    assert 1.9 < r0["waited"] < 15.0
    assert r0["scaler_steps"] == 0  # the failed step changed nothing


def test_the_overflow_timeout_is_configurable(monkeypatch: pytest.MonkeyPatch) -> None:
    from mixprec.errors import PolicyError
    from mixprec_torch.step.distributed import overflow_timeout, set_overflow_timeout

    monkeypatch.delenv("MIXPREC_OVERFLOW_TIMEOUT", raising=False)
    assert overflow_timeout() == 300.0
    monkeypatch.setenv("MIXPREC_OVERFLOW_TIMEOUT", "12.5")
    assert overflow_timeout() == 12.5
    set_overflow_timeout(3)
    try:
        assert overflow_timeout() == 3.0
    finally:
        set_overflow_timeout(None)
    for bad in ("0", "-1", "soon", "inf"):
        monkeypatch.setenv("MIXPREC_OVERFLOW_TIMEOUT", bad)
        with pytest.raises(PolicyError, match="MIXPREC_OVERFLOW_TIMEOUT must be a positive"):
            overflow_timeout()
    with pytest.raises(PolicyError, match="set_overflow_timeout"):
        set_overflow_timeout(0)


@two_ranks
def test_ddp_inf_on_one_rank_skips_the_step_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    r0, r1 = scenario(ranks, "ddp_skip")
    for r in (r0, r1):
        assert r["after_first"]["skipped_steps"] == 0
        assert r["after_inf"] == {
            "loss_scale": r["scale_init"] * 0.5,  # backed off on both ranks
            "skipped_steps": 1,
            "last_step_skipped": True,
        }
        assert r["unchanged_by_skip"], "a skipped step changed the weights"
        assert r["final"]["skipped_steps"] == 1
        assert not r["final"]["last_step_skipped"]
        assert r["params_final"] != r["params_after_skip"], "training did not continue"
    assert r0["params_after_skip"] == r1["params_after_skip"]
    assert r0["params_final"] == r1["params_final"]
    assert r0["masters_final"] == r1["masters_final"]


@two_ranks
def test_ddp_bf16_policies_keep_ranks_identical(ranks: list[dict[str, Any]]) -> None:
    r0, r1 = scenario(ranks, "ddp_bf16")
    for policy in (
        "O2-bf16", "O1-bf16", "O3-bf16-kahan", "O3-bf16-sr", "O3-bf16-sr,state=bfloat16",
        "O2-bf16,state=int8(min_size=0)",
    ):  # fmt: skip
        a, b = r0[policy], r1[policy]
        assert a["moved"] and b["moved"]
        assert a["params"] == b["params"], f"{policy}: ranks diverged"
        assert a["losses"] != b["losses"]  # they did see different data
        assert a["state"]["skipped_steps"] == b["state"]["skipped_steps"] == 0
    assert r0["O2-bf16"]["param_dtypes"] == [
        "torch.bfloat16", "torch.bfloat16",  # Linear
        "torch.float32", "torch.float32",  # BatchNorm pinned to float32
        "torch.bfloat16", "torch.bfloat16",  # Linear
    ]  # fmt: skip
    assert set(r0["O1-bf16"]["param_dtypes"]) == {"torch.float32"}
    assert r0["O2-bf16,state=int8(min_size=0)"]["moment_dtypes"] == ["torch.uint8"]


@two_ranks
def test_fsdp2_bf16_trains_and_skips_together(ranks: list[dict[str, Any]]) -> None:
    r0, r1 = scenario(ranks, "fsdp_bf16")
    for r in (r0, r1):
        assert r["bn_sharded_separately"]
        assert r["shard_dtypes"] == ["torch.float32"]  # FSDP's fp32 shards are the masters
        assert r["masters_are_params"]
        assert r["dtypes_seen"] == {
            "linear.in": "torch.bfloat16",
            "linear.out": "torch.bfloat16",
            "bn.in": "torch.float32",  # the pinned island computes in float32 ...
            "bn.out": "torch.float32",  # ... and FSDP casts its output back to bfloat16
            "head.in": "torch.bfloat16",
            "head.out": "torch.bfloat16",  # the root casts the model output to float32
        }
        assert r["after_inf"]["skipped_steps"] == 1
        assert r["after_inf"]["last_step_skipped"]
        assert r["unchanged_by_skip"], "a skipped step changed the weights"
        assert r["final"]["skipped_steps"] == 1
        assert r["moved_after_skip"], "training did not continue"


@two_ranks
def test_fsdp2_o1_bf16_shards_in_float32_and_casts_per_op(ranks: list[dict[str, Any]]) -> None:
    r0, r1 = scenario(ranks, "fsdp_o1_bf16")
    for r in (r0, r1):
        assert not r["bn_sharded_separately"]  # pinned to float32 like everything around it
        assert r["shard_dtypes"] == ["torch.float32"]
        assert r["dtypes_seen"]["linear.out"] == "torch.bfloat16"  # the op ran in bfloat16
        assert r["dtypes_seen"]["bn.out"] == "torch.float32"
        assert r["state"]["skipped_steps"] == 0
        assert r["moved"]
    assert r0["losses"] != r1["losses"]  # each rank trained on its own data


# --------------------------------------------------------------------------------------------
# one process


def test_found_inf_is_returned_unchanged_without_a_process_group() -> None:
    assert not is_distributed()
    found_inf = torch.ones(1)
    assert all_reduce_found_inf(found_inf) is found_inf
    assert found_inf.item() == 1.0


def test_plain_modules_and_tensors_are_not_fsdp() -> None:
    model = torch.nn.Linear(2, 2)
    assert not is_fsdp_managed(model)
    assert local_tensor(model.weight) is model.weight


@pytest.mark.parametrize(
    ("policy", "param", "reduce", "output"),
    [
        ("O2-bf16", torch.bfloat16, torch.float32, torch.float32),
        ("O2", torch.float16, torch.float32, torch.float32),
        ("O1-bf16", torch.float32, torch.float32, torch.float32),
    ],
)
def test_policy_translates_to_fsdp_mixed_precision(
    policy: str, param: Any, reduce: Any, output: Any
) -> None:
    mp = fsdp_mixed_precision_policy(policy)
    assert mp.param_dtype == param
    assert mp.reduce_dtype == reduce
    assert mp.output_dtype == output
    assert mp.cast_forward_inputs


@pytest.fixture
def one_rank_group() -> Any:
    """A gloo process group of one rank in this process, destroyed afterwards."""
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
    )
    try:
        yield
    finally:
        gc.collect()  # FSDP modules left in cycles would keep the group alive past destroy
        torch.distributed.destroy_process_group()


@needs_gloo
def test_fully_shard_with_policy_shards_blocks_and_pinned_islands(one_rank_group: Any) -> None:
    from torch.distributed.fsdp import FSDPModule

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    model = torch.nn.Sequential(block, torch.nn.ReLU(), torch.nn.Linear(4, 2))
    seen: dict[str, torch.dtype] = {}
    for name, module in (("linear", block[0]), ("bn", block[1]), ("block", block)):
        module.register_forward_hook(lambda m, args, out, name=name: seen.update({name: out.dtype}))
    fully_shard_with_policy(model, "O2-bf16", blocks=[block])

    assert is_fsdp_managed(model)
    assert not is_distributed()  # one rank: all_reduce_found_inf has nothing to do
    assert [isinstance(m, FSDPModule) for m in (model, block, block[0], block[1])] == [
        True, True, False, True,
    ]  # fmt: skip
    assert fsdp_policy_of(model) == mixprec.get_policy("O2-bf16")
    out = model(torch.randn(3, 4))
    assert seen == {
        "linear": torch.bfloat16,
        "bn": torch.float32,  # before FSDP casts the island's output back ...
        "block": torch.bfloat16,  # ... to the block's dtype
    }
    assert out.dtype == torch.float32  # policy.output


def test_sharding_a_model_wrap_already_converted_is_refused() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = mixprec.torch.wrap(model, optimizer, policy="O2-bf16")
    with pytest.raises(mixprec.WrapError, match="shard first"):
        fully_shard_with_policy(model, "O2-bf16")


def test_fsdp_refuses_an_unresolved_auto_policy() -> None:
    with pytest.raises(mixprec.PolicyError, match="auto"):
        fully_shard_with_policy(torch.nn.Linear(2, 2), "auto")


def test_distributed_helpers_are_exported_through_the_facade() -> None:
    import mixprec_torch
    import mixprec_torch.step.distributed as dist
    import mixprec_torch.wrapping.sharding as sharding

    for module, name in (
        (sharding, "fully_shard_with_policy"),
        (sharding, "fsdp_mixed_precision_policy"),
        (sharding, "register_ddp_reduce_hook"),
        (dist, "all_reduce_found_inf"),
    ):
        assert name in mixprec_torch.__all__
        assert getattr(mixprec.torch, name) is getattr(module, name), name


@pytest.mark.parametrize("other_rank_overflowed", [False, True])
def test_a_rank_without_gradients_still_joins_the_found_inf_reduction(
    monkeypatch: pytest.MonkeyPatch, other_rank_overflowed: bool
) -> None:
    """Every rank must call the collective, or the ranks that do wait forever."""
    import mixprec_torch.step.protocol as step_module

    calls: list[float] = []

    def spy(found: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        calls.append(found.item())
        # what the MAX all-reduce returns when another rank saw an inf
        return found.fill_(1.0) if other_rank_overflowed else found

    monkeypatch.setattr(step_module, "is_distributed", lambda *_: True)
    monkeypatch.setattr(step_module, "all_reduce_found_inf", spy)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *_: 0)  # the skip warning's rank
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = mixprec.torch.wrap(model, optimizer, policy="O2-bf16")
    before = [p.detach().clone() for p in model.parameters()]
    unrelated = torch.ones(1, requires_grad=True)  # this rank's loss does not reach the model
    with mixprec.torch.scale_loss((unrelated * 2).sum(), optimizer) as scaled:
        scaled.backward()
    assert all(p.grad is None for p in model.parameters())
    optimizer.step()

    assert calls == [0.0]  # joined with a zero flag
    assert mixprec.torch.state(optimizer).last_step_skipped is other_rank_overflowed
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_single_process_without_gradients_makes_no_collective_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import mixprec_torch.step.protocol as step_module

    calls: list[torch.Tensor] = []
    monkeypatch.setattr(
        step_module, "all_reduce_found_inf", lambda f, *_, **__: calls.append(f) or f
    )
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = mixprec.torch.wrap(model, optimizer, policy="O2-bf16")
    with mixprec.torch.scale_loss(torch.ones(1, requires_grad=True).sum(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    assert calls == []
    assert not mixprec.torch.state(optimizer).last_step_skipped


@needs_gloo
def test_wrap_refuses_a_model_sharded_under_another_policy(one_rank_group: Any) -> None:
    def sharded() -> tuple[Any, Any]:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        fully_shard_with_policy(model, "O2-bf16")
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    model, optimizer = sharded()
    with pytest.raises(mixprec.WrapError, match="sharded") as info:
        mixprec.torch.wrap(model, optimizer, policy="O1-bf16")
    message = str(info.value)
    assert str(mixprec.get_policy("O2-bf16")) in message
    assert str(mixprec.get_policy("O1-bf16")) in message
    assert not hasattr(model, "_mixprec")  # nothing was converted

    model, optimizer = sharded()
    model, optimizer = mixprec.torch.wrap(model, optimizer, policy="O2-bf16")  # the same: fine
    assert fsdp_policy_of(model) == mixprec.torch.state(optimizer).policy


# --------------------------------------------------------------------------------------------
# scale-out (issue 37): each finding, run as it was found (two gloo ranks)


@pytest.fixture(scope="module")
def scale_out(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(
        ["fsdp_after_wrap", "fsdp_user_mp", "dcp_resume", "process_groups"],
        tmp_path_factory.mktemp("scale_out"),
    )


@two_ranks
def test_fsdp_after_wrap_is_refused_at_the_first_step(scale_out: list[dict[str, Any]]) -> None:
    for r in scenario(scale_out, "fsdp_after_wrap"):
        # wrap, then a plain fully_shard: trained nothing before; now the first step refuses
        assert r["fully_shard"].startswith("WrapError: the wrapped model's parameters")
        assert "fully_shard_with_policy" in r["fully_shard"]
        assert r["fully_shard_masters_unchanged"] and r["fully_shard_steps"] == 0
        # wrap, then FSDP1 (use_orig_params=True): a size-mismatch crash before
        assert r["fsdp1_after"].startswith("WrapError: the wrapped model's parameters")
        # FSDP1, then wrap: the recipe it names is FSDP2's, which trains (fsdp_bf16 above)
        assert r["fsdp1_before"].startswith("WrapError: model 0 is wrapped in Fully")
        assert "fully_shard_with_policy" in r["fsdp1_before"]


@two_ranks
def test_a_users_fsdp2_mixed_precision_is_read(scale_out: list[dict[str, Any]]) -> None:
    for r in scenario(scale_out, "fsdp_user_mp"):
        assert r["float16"].startswith("WrapError: the model was sharded with fully_shard(")
        assert "float16" in r["float16"] and "O2-bf16" in r["float16"]
        assert r["float16_not_wrapped"]
        assert r["bfloat16_moved"]  # the matching dtype is accepted and trains
        assert r["consensus_is_mesh_group"]  # the overflow flag goes over FSDP's mesh


@two_ranks
def test_dcp_saves_and_resumes_exactly(scale_out: list[dict[str, Any]]) -> None:
    for r in scenario(scale_out, "dcp_resume"):
        for name in ("ddp-O2", "fsdp-O2-bf16", "fsdp-O2"):
            got = r[name]
            assert got["has_mixprec_entry"], name
            assert got["template_steps"] == 0, f"{name}: DCP's dummy step was counted"
            assert got["resumed_equal"], f"{name}: params, masters or scaler differ after load"
            assert got["continued_equal"], f"{name}: training after the resume differs"
            assert got["steps"] == 4
        assert r["torch_fsdp_dummy_step"] == ""  # no StepOrderError under float16
        assert r["torch_fsdp_dummy_counted"] == 0


@two_ranks
def test_the_overflow_consensus_runs_where_gradients_are_reduced(
    scale_out: list[dict[str, Any]],
) -> None:
    r0, r1 = scenario(scale_out, "process_groups")
    assert r0["local_steps"] == 3 and "local_steps" not in r1  # rank 0 alone, no abort
    for r in (r0, r1):
        assert r["ddp_subgroup"] and r["explicit"]
        assert r["bad"].startswith("WrapError: process_group='x'")


@pytest.mark.timeout(150)
@pytest.mark.slow
@pytest.mark.distributed
@needs_gloo
def test_ddps_all_reduce_is_bounded_by_the_same_setting(tmp_path: Path) -> None:
    """A rank that fails before backward: its peer waits in DDP's all-reduce for the process
    group's timeout, which process_group_timeout() sets from MIXPREC_OVERFLOW_TIMEOUT."""
    r0, r1 = (by_name["ddp_timeout"] for by_name in run_ranks(["ddp_timeout"], tmp_path))
    assert r1 == {"warnings": []}
    # gloo words the same timeout two ways, depending on which side of the pair notices first
    assert "Timed out" in r0["raised"] or "Application timeout" in r0["raised"], r0["raised"]
    assert 1.9 < r0["waited"] < 15.0  # STALL_WAIT is 2 s; torch's default is 30 minutes


LIGHTNING_WORKER = Path(__file__).with_name("_lightning_ddp_worker.py")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _lightning_results(strategy: str, workdir: Path, configs: str) -> dict[str, list[Any]]:
    pytest.importorskip("lightning")
    env = dict(os.environ, OMP_NUM_THREADS="1", MIXPREC_DISABLE_PLUGINS="mxnet")
    port = str(_free_port())
    ranks = ["0", "1"] if strategy == "ddp" else ["0"]
    procs = [
        subprocess.Popen(
            [sys.executable, str(LIGHTNING_WORKER), strategy, r, str(workdir), port, configs],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        for r in ranks
    ]
    logs = [p.communicate(timeout=240)[0].decode(errors="replace") for p in procs]
    out: dict[str, list[Any]] = {}
    for name in configs.split(","):
        files = [workdir / f"{strategy}-{name}-rank{r}.json" for r in (0, 1)]
        if not all(f.exists() for f in files):
            pytest.fail(f"{strategy} {name} did not finish:\n" + "\n".join(s[-3000:] for s in logs))
        out[name] = [json.loads(f.read_text()) for f in files]
    return out


@pytest.mark.timeout(240)
@pytest.mark.slow
@pytest.mark.distributed
@needs_gloo
def test_lightning_ddp_with_the_plugin_matches_lightnings_bf16_mixed(tmp_path: Path) -> None:
    got = _lightning_results(
        "ddp", tmp_path, "mixprec-O1-bf16,lightning-bf16-mixed,mixprec-O2-bf16"
    )
    for name, (a, b) in got.items():
        assert a["params"] == b["params"], f"{name}: ranks diverged"
        assert a["losses"] != b["losses"]  # each rank saw its own data
    mine, theirs = got["mixprec-O1-bf16"], got["lightning-bf16-mixed"]
    for r in (0, 1):
        assert mine[r]["losses"] == theirs[r]["losses"]  # autocast's numbers, bit for bit
        assert mine[r]["params"] == theirs[r]["params"]
    for r, lightning in zip(got["mixprec-O2-bf16"], theirs, strict=True):
        assert r["dtypes"] == ["torch.bfloat16"] and r["steps"] == 4 and r["skipped"] == 0
        assert r["consensus_is_ddp_group"] and r["ddp_over_converted"]
        gaps = [abs(x - y) for x, y in zip(r["losses"], lightning["losses"], strict=True)]
        assert max(gaps) < 1e-2  # bfloat16 weights: close to autocast's float32 ones


@pytest.mark.timeout(240)
@pytest.mark.slow
@pytest.mark.distributed
@needs_gloo
def test_lightning_ddp_spawn_with_the_plugin_trains(tmp_path: Path) -> None:
    (a, b) = _lightning_results("ddp_spawn", tmp_path, "mixprec-O2-bf16")["mixprec-O2-bf16"]
    assert a["params"] == b["params"]
    for r in (a, b):
        assert r["steps"] == 4 and r["consensus_is_ddp_group"] and r["ddp_over_converted"]


# --------------------------------------------------------------------------------------------
# scale-out, one process


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_state_dicts_of_a_plain_wrapped_model_resume_exactly(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from mixprec.torch import get_state_dict, set_state_dict

    def build() -> tuple[Any, Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        return mixprec.torch.wrap(model, optimizer, policy="O2")

    def step(model: Any, optimizer: Any) -> None:
        optimizer.zero_grad()
        loss = model(torch.ones(3, 4)).float().square().mean()
        with mixprec.torch.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()

    model, optimizer = build()
    for _ in range(2):
        step(model, optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    assert optim_sd["param_groups"][0]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert optim_sd["mixprec"]["tracker"] == {"steps": 2}
    dcp.save(
        {"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True
    )
    model2, optimizer2 = build()
    templates = dict(zip(("model", "optim"), get_state_dict(model2, optimizer2), strict=True))
    assert mixprec.torch.state(optimizer2).steps == 0  # the dummy step under float16: silent
    dcp.load(templates, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    set_state_dict(
        model2, optimizer2, model_state_dict=templates["model"], optim_state_dict=templates["optim"]
    )
    a, b = mixprec.torch.state(optimizer2), mixprec.torch.state(optimizer)
    assert (a.loss_scale, a.steps, a.skipped_steps) == (b.loss_scale, b.steps, b.skipped_steps)
    for _ in range(2):
        step(model, optimizer)
        step(model2, optimizer2)
    for a, b in zip(
        mixprec.torch.master_params(optimizer), mixprec.torch.master_params(optimizer2), strict=True
    ):
        assert torch.equal(a, b)


def test_a_parameter_replaced_after_wrap_is_refused_at_the_first_step() -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = mixprec.torch.wrap(model, optimizer, policy="O2-bf16")
    model.weight = torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.bfloat16))
    model(torch.ones(1, 2)).float().sum().backward()
    with pytest.raises(mixprec.WrapError, match=r"weight replaced"):
        optimizer.step()
    assert mixprec.torch.state(optimizer).steps == 0


@needs_gloo
def test_low_bit_state_under_fsdp2_is_quantized_per_shard(one_rank_group: Any) -> None:
    """Once refused at wrap; now each rank keeps its shard's codes (tests/torch/
    test_lowbit_fsdp.py checks them against a reference on two ranks)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    policy = "O2-bf16,state=int8(min_size=0)"
    fully_shard_with_policy(model, policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = mixprec.torch.wrap(model, optimizer, policy=policy)
    optimizer.zero_grad()
    loss = model(torch.ones(2, 4)).float().square().mean()
    with mixprec.torch.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    state = optimizer.state[model[0].weight]
    assert type(state["exp_avg"]).__name__ == "DTensor"
    assert state["exp_avg"].dtype == torch.uint8 and state["mixprec.state"] == (0, 256, 1)
    assert local_tensor(state["exp_avg.absmax"]).numel() == 1
