"""MixprecPrecision with the real Lightning Trainer: closures (LBFGS), the precision names
Lightning reports, bad input refused before training, the import without Lightning and the
digits example."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning")

import torch.nn.functional as F  # noqa: E402
from _lightning_nets import (  # noqa: E402
    BATCH,
    BATCHES,
    LIGHTNING_MARKS,
    Net,
    assert_same_weights,
    data,
    fit,
    trainer,
)
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import mixprec.torch as mpt  # noqa: E402
from mixprec.errors import PolicyError, WrapError  # noqa: E402
from mixprec.lightning import MixprecPrecision  # noqa: E402

pytestmark = LIGHTNING_MARKS


# --------------------------------------------------------------------------- bad input, imports


@pytest.mark.parametrize(
    ("policy", "name"),
    [("O0", "32-true"), ("O1", "16-mixed"), ("O2", "16-mixed"), ("O1-bf16", "bf16-mixed"),
     ("O2-bf16", "bf16-mixed"), ("O3", "16-true"), ("O3-bf16", "bf16-true"), ("auto", "32-true")],
)  # fmt: skip
def test_trainer_precision_reports_lightnings_name_for_the_policy(policy: str, name: str) -> None:
    assert MixprecPrecision(policy).precision == name


class WithLBFGS(Net):
    """The same classifier trained by LBFGS, which re-runs Lightning's closure in step()."""

    def configure_optimizers(self) -> Any:
        return lbfgs(self)


def lbfgs(module: nn.Module) -> torch.optim.LBFGS:
    return torch.optim.LBFGS(module.parameters(), lr=0.5, max_iter=4)


def batch_loss(module: Net) -> float:
    """The loss on the first batch, with batch statistics (running stats move: call last)."""
    x, y = data()[:BATCH]
    with torch.no_grad():
        return float(F.cross_entropy(module.train()(x), y))


def test_lbfgs_trains_under_o2_bf16_as_the_plain_closure_loop() -> None:
    """Five LBFGS steps on one batch: Lightning's run equals mixprec's own closure loop."""
    start = batch_loss(WithLBFGS())
    module, tr = fit("O2-bf16", 5, module=WithLBFGS(), limit_train_batches=1)
    assert tr.global_step == 5
    assert module.net[0].weight.dtype == torch.bfloat16
    assert tr.precision_plugin.mixprec_state().skipped_steps == 0
    # LBFGS's line search re-ran Lightning's closure: more forwards than steps
    assert len(module.seen_dtypes) > 5

    plain = WithLBFGS()
    plain_model, opt = mpt.wrap(plain, lbfgs(plain), policy="O2-bf16")
    first = next(iter(DataLoader(data(), batch_size=BATCH)))

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = plain.loss(first, 0, direct=False)
        loss.backward()
        return loss

    for _ in range(5):
        opt.step(closure)
    assert_same_weights(module, plain_model)
    assert batch_loss(module) < 0.5 * start


def test_lbfgs_clips_the_float32_master_gradients_once_per_step() -> None:
    norms: list[float] = []

    class Clipped(WithLBFGS):
        def configure_gradient_clipping(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
            super().configure_gradient_clipping(optimizer, *args, **kwargs)
            grads = [m.grad for m in mpt.master_params(optimizer)]
            assert all(g is not None and g.dtype == torch.float32 for g in grads)
            norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    module, tr = fit("O2-bf16", 1, module=Clipped(), gradient_clip_val=0.05)
    assert tr.global_step == BATCHES
    assert len(norms) == BATCHES  # not once per line-search evaluation
    assert all(n <= 0.05 * 1.001 for n in norms)
    assert len(module.seen_dtypes) > BATCHES


def test_bad_policy_and_lbfgs_under_loss_scaling_are_refused_before_training() -> None:
    with pytest.raises(PolicyError):
        MixprecPrecision("O9")
    module = WithLBFGS()
    before = module.net[0].weight.detach().clone()
    with pytest.raises(WrapError, match="LBFGS") as refused:
        fit("O2", 1, module=module)
    assert "O2-bf16" in str(refused.value)  # the fix it names
    assert module.net[0].weight.dtype == torch.float32
    assert torch.equal(module.net[0].weight, before)


def test_mixprec_lightning_without_lightning_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['lightning'] = None\n"
        "import mixprec\n"
        "assert 'torch' not in sys.modules\n"
        "try:\n"
        "    import mixprec.lightning\n"
        "except mixprec.BackendNotAvailable as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert "pip install 'mixprec[lightning]'" in out


def test_the_lightning_digits_example_trains(capsys: pytest.CaptureFixture[str]) -> None:
    root = Path(__file__).resolve().parents[2]
    runpy.run_path(str(root / "examples/lightning_digits.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "precision bf16-mixed, policy O2-bf16" in out  # its asserts check the accuracy


def test_a_ddp_strategy_converts_the_module_inside_its_ddp() -> None:
    """Lightning's DDP wraps the module before the plugin sees it; the plugin converts the
    module inside and the strategy builds its DDP again (two ranks: test_distributed.py)."""
    module = Net()
    environ = dict(os.environ)
    tr = trainer("O2-bf16", 1, strategy="ddp")
    try:
        tr.fit(module, DataLoader(data(), batch_size=BATCH))
    finally:  # undo the one-rank gloo group and the variables Lightning's DDP set up
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
    assert module.net[0].weight.dtype == torch.bfloat16
    assert mpt.state(tr.optimizers[0]).steps > 0
