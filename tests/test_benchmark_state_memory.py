"""Case 10 (benchmarks/state_memory.py): the byte counts its table comes from, on a small
model, against what each policy is documented to keep per parameter with AdamW."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:  # the benchmarks package lives at the repository root
    sys.path.insert(0, ROOT)

import mixprec.torch as mpt  # noqa: E402
from benchmarks.state_memory import _kept, storage_bytes  # noqa: E402


def test_storage_bytes_counts_each_storage_once_and_empty_ones_not_at_all() -> None:
    flat = torch.zeros(10)
    empty = torch.zeros(4)
    empty.untyped_storage().resize_(0)
    assert storage_bytes([flat, flat[:5], flat.view(2, 5), empty]) == 40
    assert storage_bytes([flat.to(torch.bfloat16), torch.ones(3, dtype=torch.float64)]) == 44


@pytest.mark.parametrize(
    ("policy", "per_param", "grads_per_param"),
    [("fp32", 12, 0), ("O2-bf16", 14, 4), ("O3-bf16", 6, 0),
     ("O3-bf16-kahan", 12, 0), ("O3-bf16-sr", 10, 0),
     ("O3-bf16-kahan,state=bfloat16", 8, 0), ("O3-bf16-sr,state=bfloat16", 6, 0)],
)  # fmt: skip
def test_bytes_kept_between_steps_per_parameter(
    policy: str, per_param: int, grads_per_param: int
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.GELU(),
                                torch.nn.Linear(64, 8, bias=False))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if policy != "fp32":
        model, opt = mpt.wrap(model, opt, policy=policy)
    opt.zero_grad()
    model(torch.randn(4, 64)).float().square().mean().backward()
    opt.step()
    opt.zero_grad()
    parts, grads = _kept(model, opt)
    n = sum(p.numel() for p in model.parameters())
    counters = storage_bytes(s["step"] for s in opt.state.values())  # AdamW's step scalars
    # between steps the compensated presets' working masters are placeholders: views of one
    # shared float32 element (mixprec_torch.compensation), 4 bytes whatever the model's size
    placeholder = 4 if "-kahan" in policy or "-sr" in policy else 0
    if placeholder:
        assert parts["masters"] == placeholder
    assert sum(parts.values()) - counters == per_param * n + placeholder
    assert grads == grads_per_param * n
