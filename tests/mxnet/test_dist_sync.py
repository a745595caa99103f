"""Distributed Gluon training on kvstore ``dist_sync``: workers skip together and stay equal.

The cluster tests start a real parameter-server cluster on 127.0.0.1 (a scheduler, one
server, two workers running ``_dist_worker.py``), bounded in time and always cleaned up,
and compare what each worker wrote. Each runs with a plain ``gluon.Trainer`` driven through
``mixprec_mxnet.step.distributed`` (the mechanism alone) and with ``mixprec.mxnet.Trainer`` (what
users run) under O1-bf16 and O2-bf16, always with an explicit dynamic loss scale. The
in-process tests cover the helpers' single-process behaviour and their refusals.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

mx = pytest.importorskip("mxnet")
np = pytest.importorskip("numpy")

from mixprec.errors import UnsupportedDtypeError, WrapError  # noqa: E402
from mixprec_mxnet.step.distributed import (  # noqa: E402
    FOUND_INF_KEY,
    all_reduce_found_inf,
    init_kvstore_eagerly,
    is_distributed,
)

# cpu_isa: the reference loop moves the ops this CPU has no bfloat16 kernel for to float32,
# so its lists differ between AVX2 and AVX512-BF16 CPUs (tests/test_cpu_isa.py runs both)
pytestmark = [pytest.mark.mxnet, pytest.mark.cpu_isa]

WORKER = Path(__file__).with_name("_dist_worker.py")
NUM_WORKERS = 2
CLUSTER_TIMEOUT = 45.0  # seconds for the whole cluster; a healthy run takes 3 to 7

# the worker's constants the assertions depend on
STEPS, INJECT_STEP, INIT_SCALE = 4, 1, 2.0**10

# (training loop, policy): the gluon loop is the mechanism alone, the others are the user's
# Trainer with op casting (O1) and with bfloat16 weights and float32 masters (O2)
SETUPS = [
    pytest.param("gluon", "O1-bf16", id="gluon.Trainer-O1-bf16"),
    pytest.param("mixprec", "O1-bf16", id="mixprec.Trainer-O1-bf16"),
    pytest.param("mixprec", "O2-bf16", id="mixprec.Trainer-O2-bf16"),
]


# --------------------------------------------------------------------------------------------
# the cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: takes any children too
        except ProcessLookupError:
            pass
    proc.wait()


def run_cluster(
    mode: str, case: str, policy: str, workdir: Path, **extra_env: str
) -> list[dict[str, Any]]:
    """Run CASE on a scheduler, a server and two workers; return the results, rank 0 first.

    Everything is killed after CLUSTER_TIMEOUT seconds at the latest (ps-lite waits forever
    for a peer that died), and in any case before this returns.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PS_"))}
    env.update(
        DMLC_PS_ROOT_URI="127.0.0.1",
        DMLC_PS_ROOT_PORT=str(_free_port()),
        DMLC_NODE_HOST="127.0.0.1",
        DMLC_NUM_SERVER="1",
        DMLC_NUM_WORKER=str(NUM_WORKERS),
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="",
        **extra_env,
    )
    roles = [("scheduler", [sys.executable, "-c", "import mxnet"])]
    roles.append(("server", [sys.executable, "-c", "import mxnet"]))
    roles += [
        (f"worker{i}", [sys.executable, str(WORKER), mode, case, policy, str(i), str(workdir)])
        for i in range(NUM_WORKERS)
    ]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    deadline = time.monotonic() + CLUSTER_TIMEOUT
    try:
        for name, argv in roles:
            role = "worker" if name.startswith("worker") else name
            with (workdir / f"{name}.log").open("wb") as log:
                procs[name] = subprocess.Popen(
                    argv,
                    env=dict(env, DMLC_ROLE=role),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        # workers first: the scheduler and the server exit once the workers have finished
        # (not after a worker died: they wait for it for ever, and are killed below)
        last = [] if case == "dead" else ["server", "scheduler"]
        for name in [*(n for n in procs if n.startswith("worker")), *last]:
            try:
                procs[name].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
    finally:
        for proc in procs.values():
            _kill(proc)
    bad = {n: p.returncode for n, p in procs.items() if n.startswith("worker") and p.returncode}
    if bad:
        logs = "\n".join(
            f"--- {name} (exit {procs[name].returncode}) ---\n"
            + (workdir / f"{name}.log").read_text(errors="replace")[-3000:]
            for name in procs
        )
        pytest.fail(f"{mode}/{case}/{policy}: workers failed or timed out: {bad}\n{logs}")
    files = [workdir / f"worker{i}.json" for i in range(NUM_WORKERS)]
    if case == "dead":  # the worker that died wrote nothing
        files = [f for f in files if f.exists()]
    results = [json.loads(f.read_text()) for f in files]
    results.sort(key=lambda r: r["rank"])
    ranks = [r["rank"] for r in results]
    assert ranks == ([0] if case == "dead" else list(range(NUM_WORKERS)))
    for r in results:
        assert r["num_workers"] == NUM_WORKERS
        assert r.pop("mixprec_warnings") == [], f"rank {r['rank']} warned"
    return results


DEAD_TIMEOUT = 4.0


@pytest.mark.parametrize("policy", ["O1-bf16", "O2-bf16"])
def test_a_dead_worker_is_a_distributed_error_within_the_timeout(
    policy: str, tmp_path: Path
) -> None:
    """Rank 1 exits at step INJECT_STEP; rank 0's step used to wait in the kvstore for
    ever. Now its overflow check's wait is bounded by MIXPREC_OVERFLOW_TIMEOUT."""
    started = time.monotonic()
    results = run_cluster(
        "mixprec", "dead", policy, tmp_path, MIXPREC_OVERFLOW_TIMEOUT=str(DEAD_TIMEOUT)
    )
    alive = results[0]
    assert alive["step"] == INJECT_STEP
    assert "MIXPREC_OVERFLOW_TIMEOUT" in alive["error"]
    assert "restart the job from its last checkpoint" in alive["error"]
    assert DEAD_TIMEOUT <= alive["waited"] < DEAD_TIMEOUT + 10
    assert time.monotonic() - started < CLUSTER_TIMEOUT


def _max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(float(np.max(np.abs(np.subtract(x, y)))) for x, y in zip(a, b, strict=True))


# --------------------------------------------------------------------------------------------
# two workers


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize(("mode", "policy"), SETUPS)
def test_inf_on_one_worker_skips_the_step_on_both(mode: str, policy: str, tmp_path: Path) -> None:
    r0, r1 = run_cluster(mode, "skip", policy, tmp_path)
    for r in (r0, r1):
        skipped = [s["skipped"] for s in r["steps"]]
        assert skipped == [i == INJECT_STEP for i in range(STEPS)], f"rank {r['rank']}"
        # backoff after the skip, growth after two clean steps (interval=2)
        scales = [INIT_SCALE, INIT_SCALE, INIT_SCALE / 2, INIT_SCALE / 2]
        assert [s["scale"] for s in r["steps"]] == scales, f"rank {r['rank']}"
        assert r["loss_scale"] == INIT_SCALE
        assert r["skipped_steps"] == 1
        # the skipped step left the weights alone: the next loss is the same
        assert r["steps"][INJECT_STEP + 1]["loss"] == r["steps"][INJECT_STEP]["loss"]
        assert r["steps"][-1]["loss"] < r["steps"][0]["loss"], "training did not progress"
    if mode == "gluon":
        # the gluon loop checks gradients before the reduce: only the vote told rank 0
        assert r0["steps"][INJECT_STEP]["local_found_inf"] == 0.0
        assert r1["steps"][INJECT_STEP]["local_found_inf"] == 1.0
        assert r0["steps"][INJECT_STEP]["found_inf"] == r1["steps"][INJECT_STEP]["found_inf"] == 1
    assert r0["masters"] == r1["masters"], "the workers' weights diverged"
    assert r0["params"] == r1["params"], "the workers' weights diverged"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize(("mode", "policy"), SETUPS)
def test_dist_sync_training_matches_one_process_on_the_whole_batch(
    mode: str, policy: str, tmp_path: Path
) -> None:
    r0, r1 = run_cluster(mode, "equal", policy, tmp_path)
    # the workers started from different random weights; the kvstore gave both rank 0's
    assert r0["seeded_params"] != r1["seeded_params"]
    assert r0["initial_masters"] == r1["initial_masters"] == r0["seeded_params"]
    assert r0["initial_params"] == r1["initial_params"]
    for r in (r0, r1):
        assert not any(s["skipped"] for s in r["steps"])
    assert [s["loss"] for s in r0["steps"]] != [s["loss"] for s in r1["steps"]]  # own shards
    assert r0["masters"] == r1["masters"], "the workers' weights diverged"
    assert r0["params"] == r1["params"], "the workers' weights diverged"
    moved = _max_abs_diff(r0["masters"], r0["initial_masters"])
    assert moved > 0.1, "training barely moved the weights: the comparison would be vacuous"
    # Same result as one process on the concatenated batch, up to bfloat16 rounding (the
    # halves' weight gradients are rounded to bfloat16 before the server adds them). A
    # gradient that was not summed over workers, or summed twice, is off by ~moved / 2.
    assert _max_abs_diff(r0["masters"], r0["reference_masters"]) < 0.02 * moved


# --------------------------------------------------------------------------------------------
# one process


def _trainer(kvstore: Any, contexts: list[Any], **kwargs: Any) -> Any:
    net = mx.gluon.nn.Dense(2, in_units=3)
    net.initialize(ctx=contexts)
    return mx.gluon.Trainer(
        net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore=kvstore, **kwargs
    )


class _TwoWorkerStore(mx.kvstore.KVStoreBase):  # type: ignore[misc]
    """A stand-in for a collective kvstore (Horovod-like): the other worker mirrors us."""

    def __init__(self) -> None:
        self.pushpulls: list[Any] = []

    @property
    def type(self) -> str:
        return "two_worker_test"

    @property
    def rank(self) -> int:
        return 0

    @property
    def num_workers(self) -> int:
        return 2

    def broadcast(self, key: Any, value: Any, out: Any, priority: int = 0) -> None:
        for o in out if isinstance(out, list) else [out]:
            if o is not value:
                value.copyto(o)

    def pushpull(self, key: Any, value: Any, out: Any = None, priority: int = 0) -> None:
        self.pushpulls.append(key)
        (value * 2).copyto(out if out is not None else value)

    def is_capable(self, capability: str) -> bool:
        return False

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        raise NotImplementedError

    def load_optimizer_states(self, fname: str) -> None:
        raise NotImplementedError


@pytest.mark.parametrize(
    ("flag", "expected"), [(0.0, 0.0), (1.0, 1.0), (float("inf"), 1.0), (float("nan"), 1.0)]
)
def test_found_inf_without_a_kvstore_is_the_local_flag(flag: float, expected: float) -> None:
    out = all_reduce_found_inf(None, mx.nd.full((1,), flag))
    assert out.shape == (1,)
    assert out.dtype == np.float32
    assert out.asscalar() == expected


def test_found_inf_flags_of_several_contexts_are_counted() -> None:
    flags = [mx.nd.full((1,), 0.0, ctx=mx.cpu(0)), mx.nd.full((1,), 1.0, ctx=mx.cpu(1))]
    assert all_reduce_found_inf(None, flags).asscalar() == 1.0
    flags.append(mx.nd.full((1,), 3.0, ctx=mx.cpu(2)))
    assert all_reduce_found_inf(None, flags).asscalar() == 2.0


def test_one_context_has_no_kvstore() -> None:
    trainer = _trainer("device", [mx.cpu()], update_on_kvstore=False)
    assert init_kvstore_eagerly(trainer) is None
    assert trainer._kv_initialized
    assert not is_distributed(None)


def test_local_kvstore_is_created_eagerly_and_stays_local() -> None:
    trainer = _trainer("local", [mx.cpu(0), mx.cpu(1)], update_on_kvstore=False)
    assert not trainer._kv_initialized
    kvstore = init_kvstore_eagerly(trainer)
    assert kvstore is trainer._kvstore
    assert kvstore.type == "local"
    assert not trainer._params_to_init  # broadcast already
    assert not is_distributed(kvstore)
    assert init_kvstore_eagerly(trainer) is kvstore  # idempotent
    assert all_reduce_found_inf(kvstore, mx.nd.full((1,), 1.0)).asscalar() == 1.0


def test_weights_without_shapes_get_their_kvstore_at_the_first_step() -> None:
    net = mx.gluon.nn.Dense(2)  # no in_units: shapes come with the first forward pass
    net.initialize(ctx=[mx.cpu(0), mx.cpu(1)])
    trainer = mx.gluon.Trainer(
        net.collect_params(), "sgd", kvstore="local", update_on_kvstore=False
    )
    assert init_kvstore_eagerly(trainer) is None  # the constructor's call: nothing to size yet
    assert not trainer._kv_initialized
    net(mx.nd.ones((1, 3), ctx=mx.cpu(0)))
    kvstore = init_kvstore_eagerly(trainer)  # the first step's call
    assert kvstore is not None and kvstore.type == "local"
    assert not trainer._params_to_init


def test_updating_on_the_kvstore_is_refused() -> None:
    trainer = _trainer("local", [mx.cpu(0), mx.cpu(1)], update_on_kvstore=True)
    with pytest.raises(WrapError, match="update_on_kvstore=False"):
        init_kvstore_eagerly(trainer)


def test_a_collective_kvstore_sums_the_flag_through_the_reserved_key() -> None:
    store = _TwoWorkerStore()
    assert is_distributed(store)
    trainer = _trainer(store, [mx.cpu()], update_on_kvstore=False)
    assert init_kvstore_eagerly(trainer) is store
    assert all_reduce_found_inf(store, mx.nd.full((1,), 1.0)).asscalar() == 2.0
    assert store.pushpulls == [FOUND_INF_KEY]


def test_bfloat16_gradients_are_refused_on_a_distributed_kvstore() -> None:
    trainer = _trainer(_TwoWorkerStore(), [mx.cpu()], update_on_kvstore=False)
    trainer._params[0].cast(np.dtype([("bfloat16", np.uint16)]))
    with pytest.raises(UnsupportedDtypeError, match="bfloat16"):
        init_kvstore_eagerly(trainer)


class _SimulatedDistStore(mx.kvstore.KVStoreBase):  # type: ignore[misc]
    """One worker's view of a ``dist_sync`` server shared with rank 0, in process.

    As on a real server, ``init`` stores rank 0's value only (other ranks' values are
    dropped) and a pull returns what the server holds, in the key's dtype.
    """

    def __init__(self, rank: int, server: dict[Any, Any]) -> None:
        self._rank, self.server = rank, server

    @property
    def type(self) -> str:
        return "dist_sync"

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def num_workers(self) -> int:
        return 2

    def init(self, key: Any, value: Any) -> None:
        if self._rank == 0:
            self.server[key] = value.copy()

    def broadcast(self, key: Any, value: Any, out: Any, priority: int = 0) -> None:
        self.init(key, value)
        for o in out if isinstance(out, list) else [out]:
            assert o.dtype == self.server[key].dtype, "a pull must not change the dtype"
            self.server[key].copyto(o)

    def pushpull(self, key: Any, value: Any, out: Any = None, priority: int = 0) -> None:
        if out is not None:
            value.copyto(out)

    def is_capable(self, capability: str) -> bool:
        return False

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        raise NotImplementedError

    def load_optimizer_states(self, fname: str) -> None:
        raise NotImplementedError


@pytest.mark.parametrize("reduce", ["float32", "float16"])
def test_every_worker_starts_from_rank_0s_exact_masters(reduce: str) -> None:
    # float16 reduce with float32 masters and bfloat16 weights: the gradient keys have a
    # dtype of their own, and the masters must still arrive exactly (not rounded to it)
    from _mx_nets import master_values, mlp, values

    from mixprec_mxnet import Trainer

    server: dict[Any, Any] = {}
    # each rank's own process names its layers from a fresh counter (dense0_, dense1_):
    # gluon.Trainer orders parameters by name, so ranks simulated in one process need the
    # same names, whatever layers earlier tests created
    nets, trainers = [], []
    for seed in (0, 1):
        with mx.name.NameManager():
            nets.append(mlp(seed=seed))
    for rank, net in enumerate(nets):
        store = _SimulatedDistStore(rank, server)
        trainers.append(Trainer(net, "sgd", policy="O2-bf16", kvstore=store, reduce=reduce))
    assert trainers[1].reduce_dtype(nets[1][0].weight) == reduce
    assert server[0].dtype == np.dtype(reduce)  # the gradient key is in the reduce dtype
    rank0, rank1 = master_values(trainers[0], nets[0]), master_values(trainers[1], nets[1])
    assert not np.array_equal(rank0["0.weight"], values(nets[1])["0.weight"])  # were different
    for name in rank0:
        np.testing.assert_array_equal(rank1[name], rank0[name])
    model0, model1 = values(nets[0]), values(nets[1])
    for name in model0:
        np.testing.assert_array_equal(model1[name], model0[name])
