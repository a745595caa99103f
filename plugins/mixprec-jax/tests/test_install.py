"""``pip install 'mixprec[jax]' flax`` works the way a release would (issue 36): the page's
shell commands (docs/jax.md), run in fresh virtual environments, offline.

A copy of the working tree (the files git tracks or would track, as a clean clone has them)
builds the wheels with ``make dist``; a fresh environment installs ``mixprec[jax]`` and flax
from those wheels and ``build/wheelhouse`` alone (``--no-index``: the third-party wheels
pinned in ``constraints.txt``, which ``make install``/``make test-slow`` download once), then runs
the page's first loop from a folder outside any checkout. A second environment installs from
the clone's folders, as the page's clone command does. The time from ``pip install`` to the
loop's last step is printed (run with ``-s`` to see it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import _page

pytestmark = pytest.mark.slow

ROOT = _page.ROOT
WHEELHOUSE = ROOT / "build" / "wheelhouse"


def _env(**extra: str) -> dict[str, str]:
    """The environment without this machine's pip settings or a path into the checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1", **extra}


def _run(command: list[str], cwd: Path, **extra: str) -> str:
    proc = subprocess.run(
        command, cwd=cwd, env=_env(**extra), capture_output=True, text=True, timeout=900,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def _pip(venv: Path, command: str) -> list[str]:
    """A page command ``pip install ...`` for ``venv``, offline: only the wheelhouse (and
    what the command itself names) may be installed from."""
    words = command.split()
    assert words[:2] == ["pip", "install"], command
    args = [a.strip("'") for a in words[2:]]
    # this pip installing into the venv (``--python``): what the venv's own pip would install,
    # without seeding every fresh venv with a pip of its own (4 s each)
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install"]
    return [*pip, "--no-index", "--find-links", str(WHEELHOUSE), *args]


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The working tree as a clean clone has it (no virtual environments, no build output)."""
    if not (WHEELHOUSE / ".complete").is_file():
        pytest.fail("build/wheelhouse is missing: `make install` downloads it once")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    copy = tmp_path_factory.mktemp("clone")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():  # a file another change is moving may be gone
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    return copy


def _venv(path: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, env=_env()
    )
    return path


def _loop(venv: Path, folder: Path) -> tuple[str, float]:
    """The page's first loop, run from a folder outside any checkout: output and seconds."""
    folder.mkdir()
    shutil.copy(_page.EXAMPLES / "quickstart.py", folder / "quickstart.py")
    start = time.perf_counter()
    out = _run([str(venv / "bin" / "python"), "-W", "error", "quickstart.py"], cwd=folder)
    return out, time.perf_counter() - start


def _installed_from(venv: Path, folder: Path) -> list[str]:
    code = "import mixprec, mixprec_jax; print(mixprec.__file__); print(mixprec_jax.__file__)"
    return _run([str(venv / "bin" / "python"), "-c", code], cwd=folder).split()


@pytest.fixture(scope="module")
def dist(clone: Path) -> Path:
    """The page's ``make dist`` in the clone (its build tools from the wheelhouse)."""
    assert _page.COMMANDS[2] == "make dist"
    _run(["make", "dist"], cwd=clone, PYTHON=sys.executable, PIP_NO_INDEX="1",
         PIP_FIND_LINKS=str(WHEELHOUSE))  # fmt: skip
    wheels = sorted(p.name.split("-")[0] for p in (clone / "dist").glob("*.whl"))
    assert wheels == ["mixprec", "mixprec_jax", "mixprec_numpy"], wheels
    return clone / "dist"


def test_mixprec_jax_installs_from_the_release_wheels(
    clone: Path, dist: Path, tmp_path: Path
) -> None:
    """``pip install --find-links dist 'mixprec[jax]' flax`` (the release command ``pip
    install 'mixprec[jax]' flax`` with dist/ as the index) in a fresh venv, then the loop."""
    assert _page.COMMANDS[3] == "pip install --find-links dist 'mixprec[jax]' flax"
    venv = _venv(tmp_path / "venv")
    start = time.perf_counter()
    _run(_pip(venv, _page.COMMANDS[3]), cwd=clone)
    installed = time.perf_counter() - start
    out, ran = _loop(venv, tmp_path / "user")
    assert out.endswith("skipped steps 0\n"), out
    site = str(venv / "lib")
    assert all(path.startswith(site) for path in _installed_from(venv, tmp_path / "user"))
    backends = _run([str(venv / "bin" / "mixprec"), "backends"], cwd=tmp_path / "user")
    assert backends.startswith("jax      jax 0.10.2  (plugin jax)"), backends
    print(f"\npip install 'mixprec[jax]' flax from the wheels to a running bf16 loop: "
          f"{installed + ran:.1f} s (install {installed:.1f} s, loop {ran:.1f} s)")  # fmt: skip


def test_mixprec_jax_installs_from_a_clone(clone: Path, tmp_path: Path) -> None:
    """The page's clone command: mixprec and the plugin from their folders, one command."""
    assert _page.COMMANDS[1] == "pip install . ./plugins/mixprec-jax flax"
    venv = _venv(tmp_path / "venv")
    _run(_pip(venv, _page.COMMANDS[1]), cwd=clone)
    out, _ = _loop(venv, tmp_path / "user")
    assert out.endswith("skipped steps 0\n"), out
    site = str(venv / "lib")
    assert all(path.startswith(site) for path in _installed_from(venv, tmp_path / "user"))


def test_the_plugin_folder_alone_needs_mixprec_from_somewhere(
    clone: Path, dist: Path, tmp_path: Path
) -> None:
    """``pip install ./plugins/mixprec-jax`` resolves ``mixprec>=0.1`` from the wheels of
    ``make dist``; without them (and without mixprec on an index) pip says what is missing,
    which is why the page names both folders. Resolved only (``--dry-run``)."""
    venv = _venv(tmp_path / "venv")
    with_dist = _pip(venv, "pip install --dry-run --find-links dist ./plugins/mixprec-jax")
    out = _run(with_dist, cwd=clone)
    assert "mixprec-0.1.0" in out and "mixprec-jax-0.1.0" in out, out
    proc = subprocess.run(
        _pip(venv, "pip install --dry-run ./plugins/mixprec-jax"), cwd=clone, env=_env(),
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode != 0 and "mixprec>=0.1" in proc.stderr, proc.stderr[-2000:]
