"""Hugging Face ``save_pretrained`` / ``from_pretrained`` on a wrapped model (the real
transformers package, a tiny GPT-2): the file holds the float32 values ``state_dict()``
gives, and loading them back with ``dtype=torch.float32`` restores them exactly. The config
records the wrapped model's parameter dtype, so the default load is bfloat16 (the guide says
to pass ``dtype``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import mixprec.torch as mpt  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.mark.parametrize("policy", ["O2-bf16", "O3-bf16-kahan"])
def test_save_pretrained_writes_the_float32_values_and_they_load_back(
    policy: str, tmp_path: Path
) -> None:
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=32)
    torch.manual_seed(0)
    net = transformers.GPT2LMHeadModel(config)
    model, opt = mpt.wrap(net, torch.optim.AdamW(net.parameters(), lr=1e-3), policy=policy)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    saved = model.state_dict()
    assert all(v.dtype == torch.float32 for v in saved.values() if v.is_floating_point())

    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, dtype=torch.float32)
    state = loaded.state_dict()
    compared = [k for k in saved if k in state]
    assert len(compared) >= len(saved) - 1  # the tied lm_head may be left out of one side
    for key in compared:
        assert state[key].dtype == torch.float32
        assert torch.equal(state[key], saved[key]), key
    # without dtype, transformers loads the config's dtype: what the guide warns about
    default = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert next(default.parameters()).dtype == torch.bfloat16
