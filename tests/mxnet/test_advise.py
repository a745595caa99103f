"""The precision advisor on MXNet Gluon: a candidate that raises is a report row, the user's
net and optimizer are untouched, and (where bfloat16 runs) the fragile block is named.

On a CPU without AVX512-BF16 MXNet's oneDNN has no bfloat16 FullyConnected: there the
bfloat16 candidates are the "failed" rows and the sensitivity test is skipped, saying so.
"""

from __future__ import annotations

import functools
import inspect
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

mx = pytest.importorskip("mxnet")

from mxnet import gluon  # noqa: E402

import mixprec  # noqa: E402
import mixprec.mxnet as mpx  # noqa: E402
from mixprec.advisor.run import DEFAULT_STATES  # noqa: E402
from mixprec.kit import AdviceError  # noqa: E402


class Cancelling(gluon.HybridBlock):
    """Adds and subtracts 256: exact in float32, loses everything below 2 in bfloat16."""

    def hybrid_forward(self, F: Any, x: Any) -> Any:
        return (x + 256.0) - 256.0


def fragile_net() -> gluon.HybridSequential:
    mx.random.seed(0)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(16, activation="relu"), Cancelling(), gluon.nn.Dense(4))
    net.initialize(mx.init.Xavier())
    net(mx.nd.ones((4, 8)))
    return net


def tiny_batches(n: int = 2) -> list[tuple[Any, Any]]:
    mx.random.seed(7)
    return [(mx.nd.random.normal(shape=(4, 8)), mx.nd.array([0, 1, 2, 3])) for _ in range(n)]


LOSS = gluon.loss.SoftmaxCrossEntropyLoss()


@functools.cache
def _bf16_runs() -> bool:
    """Whether a bfloat16 Dense trains here (the mixprec Trainer, one forward pass)."""
    net = gluon.nn.Dense(2)
    net.initialize()
    net(mx.nd.ones((1, 2)))
    try:
        mpx.Trainer(net, "sgd", policy="O2-bf16")
        net(mx.nd.ones((1, 2))).wait_to_read()
    except Exception:  # MXNetError from oneDNN, or a refusal up front
        return False
    return True


@pytest.mark.cpu_isa
def test_a_candidate_that_raises_is_a_failed_row_and_float32_still_advised() -> None:
    report = mpx.advise(fragile_net(), "sgd", {"learning_rate": 0.01}, tiny_batches(), LOSS,
                        ["O2-bf16"], 3, progress=False)  # fmt: skip
    assert [r.policy for r in report.runs][:2] == ["O0", "O2-bf16"]
    o0, bf16 = report.run("O0"), report.run("O2-bf16")
    assert o0.ok and len(o0.losses) == 3 and o0.loss_distance == 0.0
    if not _bf16_runs():
        assert bf16.status.startswith("failed: MXNetError: ") and bf16.loss_distance is None
        assert "could not create a primitive descriptor" in bf16.status
        assert report.recommended == "O0" and report.sensitivity_policy is None
        assert "failed: MXNetError" in report.table()
    assert str(mixprec.get_policy(report.recommended)) == report.recommended
    assert json.loads(report.to_json())["backend"] == "mxnet"


def test_users_net_and_optimizer_are_untouched() -> None:
    net = fragile_net()
    optimizer = mx.optimizer.SGD(learning_rate=0.01, momentum=0.9)
    before = {k: v.data().asnumpy().copy() for k, v in net.collect_params().items()}
    report = mpx.advise(net, optimizer, None, tiny_batches(), LOSS, ["O0"], 2, progress=False)
    after = {k: v.data() for k, v in net.collect_params().items()}
    assert all(
        (after[k].asnumpy() == v).all() and after[k].dtype == v.dtype for k, v in before.items()
    )
    assert optimizer.num_update == 0 and optimizer.learning_rate == 0.01
    # the state column: SGD's float32 momentum; the int8 twin trained, or a note says why not
    assert report.run("O0").state_bytes_per_param == 4.0
    assert "state B/param" in report.table()
    twins = [r for r in report.runs if r.state_twin == "O0"]
    refused = [n for n in report.notes if n.startswith("state=int8: not offered")]
    assert [r.policy for r in twins] == (["O0,state=int8"] if not refused else [])


def test_the_low_bit_states_offered_by_default_are_the_advisors() -> None:
    default = inspect.signature(mpx.advise).parameters["states"].default
    assert default == DEFAULT_STATES


def test_bad_arguments_are_refused_before_anything_runs() -> None:
    with pytest.raises(AdviceError, match="initialize"):
        mpx.advise(gluon.nn.Dense(2), "sgd", None, tiny_batches(), LOSS)
    with pytest.raises(AdviceError, match="gluon Block"):
        mpx.advise(object(), "sgd", None, tiny_batches(), LOSS)  # type: ignore[arg-type]
    with pytest.raises(mixprec.PolicyError):
        mpx.advise(fragile_net(), "sgd", None, tiny_batches(), LOSS, ["O9"])


@pytest.mark.cpu_isa
@pytest.mark.skipif(not _bf16_runs(), reason="MXNet's oneDNN has no bfloat16 GEMM on this CPU")
def test_cancelling_block_is_named_and_pinned_under_bf16() -> None:
    report = mpx.advise(fragile_net(), "sgd", {"learning_rate": 0.01}, tiny_batches(), LOSS,
                        ["O2-bf16"], 3, progress=False)  # fmt: skip
    assert (report.sensitivity[0].module, report.sensitivity[0].module_class) == ("1", "Cancelling")
    assert report.rules == ["path:1=float32"]
    assert all(s.added_error <= report.threshold for s in report.tuned_sensitivity)


def conv_net() -> gluon.HybridSequential:
    """A Conv2D with 16 output channels: oneDNN keeps its bfloat16 output in a blocked layout
    on a CPU with bfloat16 kernels, which MXNet's ``astype`` cannot read."""
    mx.random.seed(0)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(16, 3, padding=1), gluon.nn.BatchNorm(), gluon.nn.Activation("relu"),
            gluon.nn.Conv2D(16, 3, padding=1), gluon.nn.Flatten(), gluon.nn.Dense(4))  # fmt: skip
    net.initialize(mx.init.Xavier())
    net(mx.nd.ones((4, 1, 8, 8)))
    return net


@pytest.mark.cpu_isa
def test_module_sensitivity_reads_blocked_bfloat16_activations() -> None:
    """``make demo``'s Gluon report once ended in "note: module sensitivity failed:
    MXNetError: ... The size of NDArray doesn't match the requested MKLDNN memory desc"."""
    mx.random.seed(7)
    images = [(mx.nd.random.normal(shape=(4, 1, 8, 8)), mx.nd.array([0, 1, 2, 3]))]
    report = mpx.advise(conv_net(), "sgd", {"learning_rate": 0.01}, images, LOSS,
                        ["O2-bf16"], 2, progress=False)  # fmt: skip
    assert not [n for n in report.notes if "sensitivity failed" in n], report.notes
    assert report.sensitivity_policy == "O2-bf16"
    assert {s.module for s in report.sensitivity} >= {"0", "1", "3", "5"}
    # conv 0's bias feeds BatchNorm, which cancels it: its float32 gradient is rounding noise
    # (~1e-9), so a per-parameter relative error read 1e3 for a conv whose weight gradient
    # is off by bfloat16 rounding; the module's gradients are compared as one vector
    by_module = {s.module: s for s in report.sensitivity}
    assert by_module["0"].grad_error < 0.5, by_module["0"]


def _piped(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mixprec", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600, check=False)  # fmt: skip


#: What MXNet's C++ log prints when a oneDNN bfloat16 kernel does not exist on this CPU.
NATIVE_LOG = "could not create a primitive descriptor iterator"


@pytest.mark.slow
def test_no_framework_log_lines_in_backends_or_the_advisor(tmp_path: Path) -> None:
    """``mixprec backends`` and the advisor, in fresh processes as a user runs them: MXNet's
    oneDNN lines (C++ writes to fd 2) do not print; the advisor says why O1-bf16 has no
    block rows."""
    proc = _piped("backends", cwd=tmp_path)
    assert proc.returncode == 0 and "mxnet" in proc.stdout
    assert NATIVE_LOG not in proc.stderr and ".cc:" not in proc.stderr, proc.stderr
    docs = Path(__file__).resolve().parents[2] / "docs" / "advisor.md"
    text = docs.read_text(encoding="utf-8").split("<!-- advisor: factory my_gluon_advice.py -->")
    (tmp_path / "my_gluon_advice.py").write_text(
        text[1].split("```python\n", 1)[1].split("\n```", 1)[0] + "\n"
    )
    proc = _piped("advise", "my_gluon_advice:factory", "--candidates", "O1-bf16",
                  "--steps", "3", "--out", "advice", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert NATIVE_LOG not in proc.stderr and ".cc:" not in proc.stderr, proc.stderr
    assert all(line.startswith("advise mxnet: ") for line in proc.stderr.splitlines())
    assert "no module measured (the notes say why)" in proc.stdout
    assert "MXNet's O1 casts ops inside the hybridized graph" in proc.stdout
