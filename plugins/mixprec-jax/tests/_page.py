"""docs/jax.md read the way its tests need it: its code blocks, and the files they include.

Every fenced block of the page is either included from an example file here (the Python and
TOML blocks: ``<!-- include: PATH -->`` before the block, as on the other pages) or a shell
block whose commands are :data:`COMMANDS`, which ``test_install.py`` runs in fresh
environments.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "jax.md"
EXAMPLES = ROOT / "plugins" / "mixprec-jax" / "examples"
INCLUDE = re.compile(r"<!-- include: (\S+) -->\n```(\w+)\n(.*?)```\n<!-- end include -->", re.S)
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)

#: The page's included files, in the order it shows them.
INCLUDED = [
    "plugins/mixprec-jax/examples/quickstart.py",
    "plugins/mixprec-jax/examples/multi_device.py",
    "plugins/mixprec-jax/examples/shared_policy/policy.toml",
    "plugins/mixprec-jax/examples/shared_policy/jax_side.py",
    "plugins/mixprec-jax/examples/shared_policy/torch_side.py",
    "plugins/mixprec-jax/examples/lowbit_state.py",
]

#: The page's shell commands, in order, without their comments.
COMMANDS = [
    "pip install 'mixprec[jax]' flax",
    "pip install . ./plugins/mixprec-jax flax",
    "make dist",
    "pip install --find-links dist 'mixprec[jax]' flax",
    "mixprec backends",
]


def text() -> str:
    return PAGE.read_text(encoding="utf-8")


def includes() -> list[tuple[str, str, str]]:
    """(path, language, block) for each included block."""
    return INCLUDE.findall(text())


def fences() -> list[tuple[str, str]]:
    """(language, block) for every fenced block of the page."""
    return FENCE.findall(text())


def commands() -> list[str]:
    """The commands of the page's shell blocks, in order (comments dropped)."""
    found = []
    for language, block in fences():
        if language == "sh":
            found += [line.split("#", 1)[0].strip() for line in block.splitlines()]
    return [command for command in found if command]
