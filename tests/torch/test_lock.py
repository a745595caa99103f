"""The precision lockfile on PyTorch: what torch.autocast itself does with the ops a policy
passes through is recorded, on CPU and on CUDA (fake CUDA tensors: no GPU needed), and it
matches torch's own lists as the torch-autocast presets transcribe them."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import mixprec  # noqa: E402
import mixprec.torch as mpt  # noqa: E402
from mixprec.cli import main  # noqa: E402
from mixprec_torch.presets import AUTOCAST_LISTS, torch_autocast_policy  # noqa: E402

pytestmark = pytest.mark.torch

#: CPU autocast casts torch.lstm but not torch.gru_cell, rnn_cell's first probe; the preset
#: puts rnn_cell in lowp anyway (see mixprec_torch.presets).
_NOT_ON_CPU = {"rnn_cell"}


@pytest.mark.parametrize(("device", "compute"), [("cpu", "bfloat16"), ("cuda", "float16")])
def test_native_answers_are_autocasts_own_lists(device: str, compute: str) -> None:
    native = mpt.native_dtypes(device, compute)
    assert native.source == f"torch.autocast({device!r}, dtype=torch.{compute})"
    policy = torch_autocast_policy(device)
    checked = 0
    for family in sorted(set(native.dtypes) & set(mixprec.OP_FAMILIES)):
        if device == "cpu" and family in _NOT_ON_CPU:
            continue
        for inputs, produced in native.dtypes[family].items():
            if produced is None:  # autocast refuses it (binary_cross_entropy on CUDA)
                assert family in policy.ops.banned, family
                continue
            assert policy.decide(family, [inputs]).dtype == produced, (family, inputs)
            checked += 1
    assert checked >= 80  # nearly every family, for both inputs
    assert not torch.is_autocast_enabled("cuda")  # the fake CUDA run put the state back


def test_a_cpu_lock_records_what_autocast_does_with_passthrough_ops(tmp_path: Path) -> None:
    lock = mixprec.write_lock("O1-bf16", "torch", tmp_path / "o1-bf16.lock")
    assert lock.native == "torch.autocast('cpu', dtype=torch.bfloat16)"
    policy = mixprec.get_policy("O1-bf16")
    # prod: O1-bf16 passes it through, and CPU autocast runs it in float32
    assert policy.ops.list_of("prod") == "passthrough" and "prod" in AUTOCAST_LISTS["cpu"]["fp32"]
    assert (lock.ops["prod"].lowp, lock.ops["prod"].native_lowp) == ("bfloat16", "float32")
    assert (lock.ops["relu"].lowp, lock.ops["relu"].native_lowp) == ("bfloat16", "bfloat16")
    # torch's own ops outside the vocabulary are autocast's to decide under O1-bf16
    assert lock.ops["torch:rms_norm"].rule.endswith("(passthrough)")
    assert lock.ops["torch:rms_norm"].native_lowp is not None
    assert lock.ops["linear"].native_lowp is None  # the policy's lowp list decides
    assert mixprec.check_lock(tmp_path / "o1-bf16.lock").ok


def test_a_cuda_lock_on_fake_tensors_records_autocasts_float32_list(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "cuda.lock"
    spec = "base=O1,passthrough+=layer_norm"
    assert main(["lock", spec, "--backend", "torch", "--device", "cuda", "-o", str(path)]) == 0
    lock = mixprec.lock.read_lock(path)
    assert (lock.device, lock.lowp) == ("cuda", "float16")
    # the policy passes layer_norm through; CUDA autocast would run it in float32
    assert "layer_norm" in AUTOCAST_LISTS["cuda"]["fp32"]
    layer_norm = lock.ops["layer_norm"]
    assert (layer_norm.lowp, layer_norm.native_lowp, layer_norm.native_float32) == (
        "float16",
        "float32",
        "float32",
    )
    # rms_norm: since torch 2.12 CUDA autocast runs it in float32 (why the lock exists)
    assert lock.ops["torch:rms_norm"].native_lowp == "float32"
    assert lock.ops["binary_cross_entropy"].lowp == "banned"
    assert main(["lock", "--check", str(path)]) == 0
    assert "every op resolves as locked" in capsys.readouterr().out
