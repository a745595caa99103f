"""The guide's "FP8" section runs as written: each ``wrap`` line on a fresh model, and the
statistics example on a model whose ``encoder.0.proj`` has a planted outlier row, where
every ``expression  # literal`` line of the example must give that literal."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import mixprec  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PYTHON = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _blocks() -> list[str]:
    guide = (ROOT / "docs" / "guide.md").read_text(encoding="utf-8")
    section = guide.split("\n### FP8\n", 1)[1].split("\n### ", 1)[0]
    return PYTHON.findall(section)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.proj(x))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(_Block())
        self.lm_head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.encoder(x))


def _namespace(outlier: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Net()
    if outlier:  # a dead unit whose weights are 2**20 times the others
        with torch.no_grad():
            model.encoder[0].proj.weight[0] *= 2.0**20
            model.encoder[0].proj.bias[0] = -1e9
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(32, 16, generator=gen), torch.randn(32, 4, generator=gen))] * 12

    def train_step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        F.mse_loss(model(x).float(), y).backward()
        opt.step()

    return {"mixprec": mixprec, "model": model, "opt": opt, "batches": batches,
            "train_step": train_step}  # fmt: skip


def test_the_guide_has_the_two_fp8_examples() -> None:
    assert len(_blocks()) == 2


def test_each_wrap_line_of_the_guide_runs() -> None:
    lines = [line for line in _blocks()[0].splitlines() if line.strip()]
    assert len(lines) == 3
    for line in lines:
        namespace = _namespace(outlier=False)
        exec(compile(line, "docs/guide.md#fp8", "exec"), namespace)
        group = namespace["model"]._mixprec.group
        assert group.fp8 is not None, line
        names = group.fp8.names
        assert ("lm_head" in names) == ("lm_head=bfloat16" not in line), (line, names)


def test_the_statistics_example_prints_what_it_says() -> None:
    import mixprec.torch  # noqa: F401  (the example's mixprec.torch)

    block = _blocks()[1]
    namespace = _namespace(outlier=True)
    exec(compile(block, "docs/guide.md#fp8", "exec"), namespace)
    checked = 0
    for line in block.splitlines():
        code, _, comment = line.partition("  # ")
        try:
            expected = ast.literal_eval(comment.strip())
        except (ValueError, SyntaxError):
            continue
        assert eval(code, namespace) == expected, line
        checked += 1
    assert checked == 3
