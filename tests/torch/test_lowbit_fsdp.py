"""Low-bit optimizer state (``state=int8|int4|fp8``) under FSDP2: each rank quantizes its own
shard (``mixprec_torch.lowbit.shards``).

The two-rank tests start two real processes (``_lowbit_fsdp_workers.py``, on
``_dist_workers.py``'s launch) in a gloo process group on 127.0.0.1; each rank compares its
run with a reference that does by hand what the state promises (torch's Adam over a plain
copy of the rank's shard, fed the same gradient shards, the moments decoded before and
encoded after each step). The one-rank tests run FSDP2 in this process over a one-rank group.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from _ranks import launch, multi_rank, needs_gloo, scenario  # noqa: E402

import mixprec  # noqa: E402
import mixprec.torch  # noqa: E402
from mixprec.kit import parse_state_format  # noqa: E402
from mixprec_torch.lowbit.codec import dequantize, quantize  # noqa: E402
from mixprec_torch.lowbit.shards import local  # noqa: E402
from mixprec_torch.wrapping.sharding import fully_shard_with_policy  # noqa: E402

pytestmark = pytest.mark.torch

WORKER = Path(__file__).with_name("_lowbit_fsdp_workers.py")
WORLD = 2


def run_ranks(scenarios: list[str], workdir: Path, timeout: float = 120.0) -> list[dict[str, Any]]:
    """Run ``scenarios`` on WORLD processes (one thread each); each rank's results."""
    results = launch(WORKER, scenarios, workdir, WORLD, timeout)
    return [scenario(results, name) for name in scenarios]


two_ranks = multi_rank(150)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Both scenarios, run once by two ranks that share one process group."""
    names = ["lowbit_fsdp_train", "lowbit_fsdp_checkpoint", "lowbit_fsdp_nonfinite"]
    results = run_ranks(names, tmp_path_factory.mktemp("lowbit_ranks"))
    return dict(zip(names, results, strict=True))


# --------------------------------------------------------------------------------------------
# two ranks


@two_ranks
@pytest.mark.parametrize("spec", ["int8(block=32,min_size=0)", "int4(block=32,min_size=0)"])
def test_each_rank_quantizes_its_shard_as_the_reference_does(
    ranks: dict[str, list[dict[str, Any]]], spec: str
) -> None:
    r0, r1 = ranks["lowbit_fsdp_train"]
    for r in (r0, r1):
        # four steps taken (the third skipped): weights, codes and absmax bit for bit
        assert r[f"{spec}.matched"] == [True, True, True, True]
        assert r[f"{spec}.decoded_shards_match_reference"]
        kind, dtype, shape, mine = r[f"{spec}.codes_are_sharded"]
        assert (kind, dtype) == ("DTensor", "torch.uint8")
        per_rank = 64 if spec.startswith("int8") else 32  # the first weight: 8 of 16 rows
        assert (shape, mine) == ([2 * per_rank], per_rank)
        assert r[f"{spec}.tags"] == [str((0 if spec.startswith("int8") else 1, 32, 2))]
    # the ranks' full state is the same wherever it is gathered
    for what in ("full_params", "full_codes", "full_moments"):
        assert r0[f"{spec}.{what}"] == r1[f"{spec}.{what}"]


@two_ranks
@pytest.mark.parametrize("spec", ["int8(block=32,min_size=0)", "int4(block=32,min_size=0)"])
def test_a_step_skipped_on_one_rank_keeps_every_ranks_codes(
    ranks: dict[str, list[dict[str, Any]]], spec: str
) -> None:
    for r in ranks["lowbit_fsdp_train"]:
        assert r[f"{spec}.skipped"]
        assert r[f"{spec}.skip_kept_codes"]  # codes, absmax and tags bit for bit
        assert r[f"{spec}.skip_kept_params"]


@two_ranks
def test_each_ranks_state_memory_is_its_shards(ranks: dict[str, list[dict[str, Any]]]) -> None:
    spec = "int8(block=32,min_size=0)"
    for r in ranks["lowbit_fsdp_train"]:
        total, params = r[f"{spec}.state_bytes"]
        # this rank's shards: 64 + 8 + 32 (+16 padding on rank 1) + 2 (+1) + 3 (+3) + 1 (+1)
        assert params in (110, 89)
        # two moments: a code byte per padded element (the same on both ranks) and a
        # float32 absmax per block (state_bytes leaves out one-element tensors: the step
        # counters, the last bias's one code, and the absmax of the five one-block shards)
        padded = 64 + 8 + 32 + 2 + 3
        assert total == 2 * (padded + 4 * 2)
        assert total < 2 * 4 * params / 3  # under a third of this rank's float32 moments


@two_ranks
def test_optimizer_state_dicts_under_fsdp2_resume_exactly(
    ranks: dict[str, list[dict[str, Any]]],
) -> None:
    for r in ranks["lowbit_fsdp_checkpoint"]:
        assert r["per_rank_codes_in_state_dict"] == "torch.uint8"
        assert r["per_rank_resumed_equal"]
        assert r["per_rank_continued_equal"]
    # a part one rank refuses is refused by every rank, none loading anything
    r0, r1 = ranks["lowbit_fsdp_checkpoint"]
    assert r1["one_rank_refused"].startswith("CheckpointError: the optimizer checkpoint's ")
    assert "int8(block=64) in 2 FSDP2 shards" in r1["one_rank_refused"]
    assert r0["one_rank_refused"].startswith("CheckpointError: another rank refused its part")
    assert r0["one_rank_refused_unchanged"] and r1["one_rank_refused_unchanged"]


@two_ranks
def test_dcp_saves_and_resumes_quantized_shards_exactly(
    ranks: dict[str, list[dict[str, Any]]],
) -> None:
    for r in ranks["lowbit_fsdp_checkpoint"]:
        assert r["dcp_template_codes"] == "torch.uint8"  # DCP's dummy step leaves codes
        assert r["dcp_template_steps"] == 0
        assert r["dcp_resumed_equal"]
        assert r["dcp_continued_equal"]
        assert r["dcp_steps"] == 4


@two_ranks
def test_a_moment_overflowing_on_one_rank_refuses_the_step_on_every_rank(
    ranks: dict[str, list[dict[str, Any]]],
) -> None:
    r0, r1 = ranks["lowbit_fsdp_nonfinite"]
    assert r1["raised"].startswith("PolicyError: state=int8(block=32,min_size=0): the ")
    assert "exp_avg_sq of parameter '0.weight' inf or NaN" in r1["raised"]
    assert r0["raised"].startswith("PolicyError: ")
    assert "another rank's shard" in r0["raised"]
    assert r0["codes_kept"] and r1["codes_kept"]


# --------------------------------------------------------------------------------------------
# one rank, in this process


@pytest.fixture
def one_rank_group() -> Any:
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
    )
    try:
        yield
    finally:
        gc.collect()
        torch.distributed.destroy_process_group()


def _optimizer(kind: str, params: Any) -> Any:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-2)


def _sharded(policy: str, kind: str = "adam", **kwargs: Any) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    fully_shard_with_policy(model, policy, **kwargs)
    return model, _optimizer(kind, model.parameters())


def _step(model: Any, optimizer: Any) -> None:
    optimizer.zero_grad()
    loss = model(torch.ones(4, 8)).float().square().mean()
    with mixprec.torch.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()


@needs_gloo
@pytest.mark.parametrize(
    ("base", "spec", "kind"),
    [
        ("O2-bf16", "int8(block=32,min_size=0)", "adam"),
        ("O0", "int4(block=32,min_size=0)", "adam"),
        ("O2-bf16", "fp8(block=32,min_size=0)", "sgd"),
    ],
)
def test_low_bit_state_under_fsdp2_trains_on_one_rank(
    one_rank_group: Any, base: str, spec: str, kind: str
) -> None:
    """What replaced the refusal: wrap takes a low-bit state under FSDP2; the moments are
    kept as codes of the shard (DTensors), the same codes as the whole tensor's on one rank."""
    policy = f"{base},state={spec}"
    model, optimizer = _sharded(policy, kind)
    model, optimizer = mixprec.torch.wrap(model, optimizer, policy=policy)
    plain = [local(p).detach().clone().requires_grad_() for p in model.parameters()]
    reference = _optimizer(kind, plain)
    fmt = parse_state_format(spec)
    keys = (
        (("exp_avg", True), ("exp_avg_sq", False))
        if kind == "adam"
        else (("momentum_buffer", True),)
    )
    codes: dict[int, dict[str, Any]] = {}
    for _ in range(3):
        _step(model, optimizer)
        for i, (p, q) in enumerate(zip(model.parameters(), plain, strict=True)):
            q.grad = local(p.grad).clone()
            for key, signed in keys:
                if i in codes:
                    c, a = codes[i][key]
                    reference.state[q][key] = dequantize(c, a, fmt, signed, q.numel()).view(q.shape)
        reference.step()
        for i, q in enumerate(plain):
            codes[i] = {k: quantize(reference.state[q][k], fmt, s) for k, s in keys}
    for i, (p, q) in enumerate(zip(model.parameters(), plain, strict=True)):
        assert torch.equal(local(p).detach(), q.detach())
        state = optimizer.state[p]
        assert state["mixprec.state"] == (("int8", "int4", "fp8").index(spec.split("(")[0]), 32, 1)
        for key, _ in keys:
            assert type(state[key]).__name__ == "DTensor"
            assert torch.equal(local(state[key]), codes[i][key][0])
            assert torch.equal(local(state[key + ".absmax"]), codes[i][key][1])


@needs_gloo
def test_codes_of_another_shard_count_are_refused_before_anything_loads(
    one_rank_group: Any,
) -> None:
    policy = "O2-bf16,state=int8(block=32,min_size=0)"
    model, optimizer = _sharded(policy)
    model, optimizer = mixprec.torch.wrap(model, optimizer, policy=policy)
    _step(model, optimizer)
    sd = optimizer.state_dict()
    before = {k: local(v).clone() for k, v in optimizer.state[model[0].weight].items()
              if isinstance(v, torch.Tensor)}  # fmt: skip
    sd["state"][0] = {**sd["state"][0], "mixprec.state": (0, 32, 2)}  # saved on two ranks
    with pytest.raises(mixprec.CheckpointError, match=r"int8\(block=32\) in 2 FSDP2 shards"):
        optimizer.load_state_dict(sd)
    after = optimizer.state[model[0].weight]
    assert all(torch.equal(local(after[k]), v) for k, v in before.items())
    plain = {**sd["state"][0], "mixprec.state": (0, 32)}  # an unsharded run's codes
    sd["state"][0] = {**plain, "exp_avg": local(plain["exp_avg"])}
    with pytest.raises(mixprec.CheckpointError, match=r"in 1 FSDP2 shards"):
        optimizer.load_state_dict(sd)


@needs_gloo
def test_a_float32_checkpoint_loads_into_sharded_low_bit_state(one_rank_group: Any) -> None:
    """The way in (a float32 state quantized on load) and out (float32_state_dict) under
    FSDP2: the moments come back as DTensors of the parameter's shape."""
    model, optimizer = _sharded("O2-bf16")
    model, optimizer = mixprec.torch.wrap(model, optimizer, policy="O2-bf16")
    _step(model, optimizer)
    saved = optimizer.state_dict()
    policy = "O2-bf16,state=int8(min_size=0)"
    model2, optimizer2 = _sharded(policy)
    model2, optimizer2 = mixprec.torch.wrap(model2, optimizer2, policy=policy)
    with pytest.warns(mixprec.MixprecWarning, match="saved under policy"):
        optimizer2.load_state_dict(saved)
    state = optimizer2.state[model2[0].weight]
    assert state["exp_avg"].dtype == torch.uint8 and state["mixprec.state"] == (0, 256, 1)
    back = mixprec.torch.float32_state_dict(optimizer2)["state"][0]["exp_avg"]
    original = saved["state"][0]["exp_avg"]
    assert type(back).__name__ == "DTensor" and back.shape == original.shape
    # int8 of the block's absmax: within half a step of the map near the largest value
    err = (local(back) - local(original)).abs().max()
    assert float(err) <= float(local(original).abs().max()) * 0.02


@needs_gloo
def test_a_parameter_sharded_otherwise_than_by_rows_is_refused_at_wrap(
    one_rank_group: Any,
) -> None:
    from torch.distributed.tensor import Shard

    policy = "O2-bf16,state=int8(min_size=0)"
    model, optimizer = _sharded(policy, shard_placement_fn=lambda p: Shard(p.ndim - 1))
    with pytest.raises(mixprec.WrapError, match=r"sharded with placements.*Shard\(dim=1\)"):
        mixprec.torch.wrap(model, optimizer, policy=policy)
    assert not hasattr(optimizer, "_mixprec")
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_with_low_bit_state_of_a_plain_model_resumes_exactly(tmp_path: Path) -> None:
    """DCP's dummy step (get_state_dict of an optimizer without state) leaves codes, so its
    template holds what a checkpoint of a low-bit state holds (no FSDP here)."""
    import torch.distributed.checkpoint as dcp

    from mixprec.torch import get_state_dict, set_state_dict

    policy = "O2-bf16,state=int8(block=32,min_size=0)"

    def build() -> tuple[Any, Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        return mixprec.torch.wrap(model, optimizer, policy=policy)

    model, optimizer = build()
    for _ in range(2):
        _step(model, optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path), no_dist=True)
    model2, optimizer2 = build()
    templates = dict(zip(("model", "optim"), get_state_dict(model2, optimizer2), strict=True))
    assert templates["optim"]["state"]["0.weight"]["exp_avg"].dtype == torch.uint8
    assert mixprec.torch.state(optimizer2).steps == 0
    dcp.load(templates, checkpoint_id=str(tmp_path), no_dist=True)
    set_state_dict(
        model2, optimizer2, model_state_dict=templates["model"], optim_state_dict=templates["optim"]
    )
    for _ in range(2):
        _step(model, optimizer)
        _step(model2, optimizer2)
    for p, q in zip(
        mixprec.torch.master_params(optimizer), mixprec.torch.master_params(optimizer2), strict=True
    ):
        assert torch.equal(p, q)
        a, b = optimizer.state[p], optimizer2.state[q]
        assert a.keys() == b.keys()
        assert all(
            torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
        )


@needs_gloo
def test_torchs_own_dcp_state_dicts_load_sharded_codes(one_rank_group: Any) -> None:
    """torch's set_state_dict passes the state keyed by parameter name: the checks pair the
    keys with the parameters through the param groups, as torch's load_state_dict does."""
    import copy

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    policy = "O2-bf16,state=int8(block=32,min_size=0)"
    model, optimizer = _sharded(policy)
    model, optimizer = mixprec.torch.wrap(model, optimizer, policy=policy)
    _step(model, optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    assert optim_sd["state"]["0.weight"]["mixprec.state"] == (0, 32, 1)
    model2, optimizer2 = _sharded(policy)
    model2, optimizer2 = mixprec.torch.wrap(model2, optimizer2, policy=policy)
    # a copy: torch's load keeps the "step" tensors (and same-dtype tensors) it is given
    set_state_dict(
        model2, optimizer2, model_state_dict=model_sd, optim_state_dict=copy.deepcopy(optim_sd)
    )
    _step(model, optimizer)
    _step(model2, optimizer2)
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(local(p), local(q))
        assert torch.equal(
            local(optimizer.state[p]["exp_avg"]), local(optimizer2.state[q]["exp_avg"])
        )
