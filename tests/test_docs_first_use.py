"""A newcomer's pages (issue 36): the troubleshooting page in the nav with a command for
each symptom, the migration note on where the overflow check runs (and the behaviour it
describes), and code blocks that do not scroll at 1280 px."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

#: Characters of code a line shows at 1280 px without a horizontal scroll bar.
CODE_WIDTH = 95

#: Lines over the width that are included verbatim from source files (the include markers
#: keep them in sync with the code), left for a change of that code: no new one may appear.
INCLUDED_OVER_WIDTH = {
    "guide.md": 6,
    "plugins.md": 4,
    "policies.md": 1,
}


def _long_code_lines(page: Path) -> list[str]:
    inside, long = False, []
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            inside = not inside
            continue
        if inside and len(line) > CODE_WIDTH:
            long.append(f"{page.relative_to(DOCS)}:{n}: {len(line)} characters")
    return long


def test_no_new_code_line_scrolls_at_1280px() -> None:
    found = {page.name: _long_code_lines(page) for page in sorted(DOCS.rglob("*.md"))}
    over = {name: lines for name, lines in found.items() if lines}
    for name, lines in over.items():
        assert len(lines) <= INCLUDED_OVER_WIDTH.get(name, 0), "\n".join(lines)


def test_troubleshooting_is_in_the_nav_with_a_command_per_symptom() -> None:
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert "troubleshooting.md" in nav
    text = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    titles = [section.splitlines()[0] for section in sections]
    for topic in ("bfloat16 is slower", "NaN", "skipped", "floor", "torch.compile", "Resum",
                  "DDP", "Is it running in bfloat16"):  # fmt: skip
        assert any(topic in title for title in titles), topic
    for section in sections:
        assert "**Cause.**" in section or "dtype_report" in section, section[:40]
        assert "```" in section, section.splitlines()[0]  # a command or a snippet
    assert "mp.dtype_report(model)" in text


def test_the_migration_note_says_where_the_overflow_check_runs() -> None:
    text = (DOCS / "migration.md").read_text(encoding="utf-8")
    torch_amp = text.split("## From torch.amp", 1)[1].split("\n## ", 1)[0]
    assert "**Where the overflow check runs.**" in torch_amp
    assert "between `unscale_` and `step()`" in torch_amp and "Nothing raises" in torch_amp


def test_a_gradient_replaced_after_unscale_is_checked_at_the_step() -> None:
    """What the note says: no error, and an inf put there after unscale_ skips the step."""
    torch = pytest.importorskip("torch")
    import mixprec.torch as mp

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = mp.wrap(model, optimizer, policy="O2-bf16")
    before = [p.detach().clone() for p in mp.master_params(optimizer)]
    loss = model(torch.randn(3, 4)).float().sum()
    with mp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    mp.unscale_(optimizer)
    first = next(iter(mp.master_params(optimizer)))
    first.grad = torch.full_like(first.grad, float("inf"))  # replaced after the unscale
    optimizer.step()  # no error
    assert mp.state(optimizer).skipped_steps == 1
    after = list(mp.master_params(optimizer))
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
