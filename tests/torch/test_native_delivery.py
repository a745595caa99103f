"""How the CPU kernels reach a user, and what the loader refuses (issue 33).

The library is built with the package (``setup.py``) and loaded from the package folder; the
developer build (``MIXPREC_NATIVE_BUILD=1``) compiles it into a private cache. Each case runs
in a fresh process (what the loader decides, and warns, is per process): the loader alone
where that says enough (no torch import), a wrapped ``O3-bf16-kahan`` step where the step
itself must survive. Attacks on the cache and the build are never a crash, never foreign
code run, never a silent slow path: the twin runs and one warning says why.

Slow: a wheel built from the checkout carries the library and runs it without a compiler;
builds of one ISA each give the twin's bits; the kernel tests pass under AddressSanitizer and
UBSan (``make sanitize``).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from mixprec_torch.cpu import clib, libfile, loader  # noqa: E402

pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parents[2]
SOURCE = libfile.SOURCE
GCC = shutil.which("gcc") or shutil.which("cc")
needs_cc = pytest.mark.skipif(GCC is None, reason="needs a C compiler")
needs_installed = pytest.mark.skipif(
    clib.info().origin != "installed", reason=f"the installed kernels: {clib.status()}"
)

# The loader alone: what it loads and what it says, without torch.
LOAD = r"""
import json, sys, warnings
from pathlib import Path
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    from mixprec_torch.cpu import loader
    if len(sys.argv) > 1:
        loader._installed = lambda: Path(sys.argv[1])
    lib, info = loader.load()
    loader.warn_once(info)
    loader.warn_once(info)
said = [str(w.message) for w in seen if w.category.__name__ == "NativeKernelsWarning"]
print(json.dumps({"origin": info.origin, "path": info.path, "reason": info.reason,
                  "isa": info.isa, "warnings": said}))
"""

# A wrapped O3-bf16-kahan step (the fused update and the guard's pass): which kernels ran.
STEP = r"""
import json, sys, warnings
from pathlib import Path
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    import torch, mixprec, mixprec_torch
    from mixprec_torch.cpu import clib, loader
    if len(sys.argv) > 1:
        loader._installed = lambda: Path(sys.argv[1])
    calls = []
    update = clib.update
    clib.update = lambda *args: (calls.append(1), update(*args))[1]
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 3)
    model, opt = mixprec.torch.wrap(
        net, torch.optim.AdamW(net.parameters(), lr=1e-2), policy="O3-bf16-kahan"
    )
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(5, 8)).float().square().mean().backward()
        opt.step()
    info = clib.info()
said = [str(w.message) for w in seen if w.category.__name__ == "NativeKernelsWarning"]
print(json.dumps({"origin": info.origin, "path": info.path, "reason": info.reason,
                  "warnings": said, "native_updates": len(calls),
                  "module": mixprec_torch.__file__,
                  "weights": [p.float().tolist() for p in model.parameters()]}))
"""

# The bits of every kernel's work: the fused update (4 policies x 3 optimizers), the guard's
# pass (a huge loss, loss scaling), the low-bit codec and fused step (3 formats), the noise
# and stochastic rounding.
DIGEST = r"""
import hashlib, json, warnings
warnings.simplefilter("error", UserWarning)
import torch, mixprec
from torch import nn
from mixprec_torch.cpu import clib, noise
torch.set_num_threads(2)
digest = hashlib.sha256()
def feed(tensors):
    for t in tensors:
        digest.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
gen = torch.Generator().manual_seed(0)
x, y = torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)
makers = [
    lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-2),
    lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, maximize=True),
    lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.8, 0.99)),
    lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=1e-2),
]
for policy in ["O3-bf16-kahan", "O3-bf16-sr", "O3-bf16-kahan,state=bfloat16",
               "O3-bf16-sr,state=bfloat16"]:
    for make in makers:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 37), nn.Tanh(), nn.Linear(37, 3))
        model, opt = mixprec.torch.wrap(net, make(list(net.parameters())), policy=policy, seed=2)
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x).float(), y).backward()
            opt.step()
        sd = opt.state_dict()
        state = [v for s in sd["state"].values() for v in s.values()]
        feed([*model.parameters(), *sd["mixprec"]["compensation"]["compensation"], *state])
for policy in ["O2", "O2-bf16", "O1"]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 5))
    model, opt = mixprec.torch.wrap(
        net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), policy=policy
    )
    for step in range(4):
        opt.zero_grad()
        loss = model(torch.randn(8, 16, generator=gen)).float().square().mean()
        with mixprec.torch.scale_loss(loss * (1e30 if step == 1 else 1.0), opt) as s:
            s.backward()
        mixprec.torch.unscale_(opt)
        feed([p.grad for p in mixprec.torch.master_params(opt)])
        opt.step()
    feed([*model.parameters()])
from mixprec.kit import parse_state_format
from mixprec_torch.lowbit import codec
x = torch.randn(1001, generator=gen) * torch.logspace(-8, 0, 1001)
x[100:132] = 0.0
for name in ["int8", "int4", "fp8"]:
    fmt = parse_state_format(name + "(block=32)")
    for signed in (True, False):
        v = x if signed else x.abs()
        codes, scale = codec.quantize(v, fmt, signed)
        feed([codes, scale, codec.dequantize(codes, scale, fmt, signed, v.numel())])
    for make in makers:  # the fused low-bit step (float32-kept tensors: keep=2.*)
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 37), nn.Tanh(), nn.Linear(37, 3))
        policy = f"O0,state={name}(block=32,min_size=0,keep=2.*)"
        model, opt = mixprec.torch.wrap(net, make(list(net.parameters())), policy=policy)
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[:96].view(16, 6)), y).backward()
            opt.step()
        state = [v for s in opt.state_dict()["state"].values() for v in s.values()]
        feed([*model.parameters(), *[v for v in state if isinstance(v, torch.Tensor)]])
feed([noise.noise(noise.pass_key(5, 3, 1), 12345, 4099)])
work = torch.randn(70001, generator=gen)
noise.round_stochastic_(work, 99, index=3)
feed([work])
print(json.dumps({"status": clib.status(), "digest": digest.hexdigest()}))
"""


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    """This environment without mixprec's settings, a compiler choice or a preload; the
    caches in ``tmp``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MIXPREC_", "ASAN_", "UBSAN_"))
        and k not in ("CC", "LD_PRELOAD", "XDG_CACHE_HOME")
    }
    env["XDG_CACHE_HOME"] = str(tmp / "xdg")
    env.update(extra)
    return env


def _python(script: str, env: dict[str, str], *args: str, timeout: float = 300) -> dict:  # type: ignore[type-arg]
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        cwd=env.get("MIXPREC_TEST_CWD", str(ROOT)),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, (
        f"rc {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )
    answer: dict = json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[type-arg]
    answer["stderr"] = done.stderr
    return answer


def _private(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def _build_env(tmp: Path, cache: Path, **extra: str) -> dict[str, str]:
    return _env(tmp, MIXPREC_NATIVE_BUILD="1", MIXPREC_CACHE_DIR=str(cache), **extra)


@pytest.fixture(scope="module")
def seed_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One developer build (default compiler and flags), copied by the tests that need a
    cache entry, so that each does not compile it again."""
    if GCC is None:
        pytest.skip("needs a C compiler")
    tmp = tmp_path_factory.mktemp("seed")
    cache = _private(tmp / "cache")
    out = _python(LOAD, _build_env(tmp, cache))
    assert out["origin"] == "built", out
    return Path(out["path"])


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> dict:  # type: ignore[type-arg]
    """The digest of the kernels' work done by the Python twin (``MIXPREC_NATIVE=0``): what
    every build must give, computed once for the tests that compare builds with it."""
    return _python(DIGEST, _env(tmp_path_factory.mktemp("twin"), MIXPREC_NATIVE="0"))


def _seeded(tmp: Path, seed_build: Path) -> tuple[Path, Path]:
    """A private cache holding the seed build under its name: (cache, library)."""
    cache = _private(tmp / "cache")
    target = cache / seed_build.name
    shutil.copy2(seed_build, target)
    target.chmod(0o700)
    return cache, target


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


# ------------------------------------------------------------------ the developer build


@needs_cc
def test_the_developer_build_compiles_once_into_a_private_cache(tmp_path: Path) -> None:
    log = tmp_path / "cc.log"
    cc = _script(tmp_path / "logcc", f'echo "$@" >> {log}\nexec {GCC} "$@"\n')
    cache = tmp_path / "fresh" / "mixprec"  # made by the build, mode 0700
    env = _build_env(tmp_path, cache, CC=str(cc))
    first = _python(LOAD, env)
    assert first["origin"] == "built" and not first["warnings"], first
    library = Path(first["path"])
    assert library.parent == cache and library.is_file()
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert stat.S_IMODE(library.stat().st_mode) & 0o077 == 0
    assert [p.name for p in cache.iterdir()] == [library.name], "no temporary left behind"
    compiles = [line for line in log.read_text().splitlines() if "--version" not in line]
    assert len(compiles) == 1 and "-march" not in compiles[0], compiles
    assert "-ffp-contract=off" in compiles[0]
    second = _python(LOAD, env)
    assert second["path"] == first["path"] and not second["warnings"]
    again = [line for line in log.read_text().splitlines() if "--version" not in line]
    assert again == compiles, "the second process compiled again"


@needs_cc
def test_a_library_cut_short_in_the_cache_is_rebuilt_never_loaded(
    tmp_path: Path, seed_build: Path
) -> None:
    """A file cut short (a full disk, a crash before the rename) killed every later process
    with SIGBUS: now it fails the checks before dlopen and is rebuilt over, and the process
    says so once."""
    cache, target = _seeded(tmp_path, seed_build)
    whole = target.stat().st_size
    with open(target, "r+b") as f:
        f.truncate(whole // 2)
    out = _python(LOAD, _build_env(tmp_path, cache))
    assert out["origin"] == "built" and out["path"] == str(target), out
    assert target.stat().st_size == whole
    assert len(out["warnings"]) == 1 and "cut short" in out["warnings"][0], out


@needs_cc
def test_a_compiler_that_writes_garbage_never_poisons_the_cache(tmp_path: Path) -> None:
    garbage = _script(
        tmp_path / "badcc",
        'if [ "$1" = --version ]; then echo badcc 1.0; exit 0; fi\n'
        'while [ $# -gt 0 ]; do if [ "$1" = -o ]; then shift; echo garbage > "$1"; fi; '
        "shift; done\nexit 0\n",
    )
    cache = _private(tmp_path / "cache")
    out = _python(LOAD, _build_env(tmp_path, cache, CC=str(garbage)))
    assert out["origin"] == "unavailable", out
    assert len(out["warnings"]) == 1 and "no usable library" in out["warnings"][0]
    assert "no ELF header" in out["warnings"][0]
    assert list(cache.iterdir()) == [], "the garbage reached the cache"
    assert _python(LOAD, _build_env(tmp_path, cache))["origin"] == "built"


def _stale_build(tmp_path: Path, missing: str = "mp_noise") -> Path:
    """A library of this source with one function renamed: a build from before it existed."""
    source = tmp_path / "stale.c"
    text = SOURCE.read_text()
    assert f"void {missing}(" in text
    source.write_text(text.replace(f"void {missing}(", f"void {missing}_old("))
    facts = libfile.source_facts()
    out = tmp_path / "stale.so"
    cmd = [GCC, *facts.cflags, "-fPIC", "-shared", facts.define(), "-o", str(out), str(source)]
    subprocess.run(cmd, check=True, capture_output=True)  # type: ignore[list-item]
    return out


@needs_cc
def test_a_stale_library_missing_a_symbol_runs_the_twin_with_one_warning(
    tmp_path: Path, seed_build: Path
) -> None:
    """A raw AttributeError from ``optimizer.step()`` on every step before: now every symbol
    is checked at load, the twin runs and one warning names the missing one."""
    stale = _stale_build(tmp_path)
    cache, target = _seeded(tmp_path, seed_build)
    shutil.copy2(stale, target)
    target.chmod(0o700)
    out = _python(STEP, _build_env(tmp_path, cache))
    assert out["origin"] == "unavailable" and out["native_updates"] == 0, out
    assert len(out["warnings"]) == 1 and "lacks mp_noise" in out["warnings"][0], out
    installed = _private(tmp_path / "site" / "mixprec_torch" / "cpu") / libfile.LIBRARY
    shutil.copy2(stale, installed)
    installed.chmod(0o755)
    out = _python(STEP, _env(tmp_path), str(installed))
    assert out["origin"] == "unavailable" and out["native_updates"] == 0, out
    assert len(out["warnings"]) == 1 and "lacks mp_noise" in out["warnings"][0], out


@needs_cc
def test_a_hanging_compiler_is_killed_and_said(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    hang = _script(
        tmp_path / "hangcc", f"echo $$ >> {pids}\nsleep 600 &\necho $! >> {pids}\nwait\n"
    )
    start = time.monotonic()
    env = _build_env(
        tmp_path, _private(tmp_path / "cache"), CC=str(hang), MIXPREC_NATIVE_BUILD_TIMEOUT="2"
    )
    out = _python(LOAD, env)
    assert time.monotonic() - start < 30
    assert out["origin"] == "unavailable", out
    assert len(out["warnings"]) == 1 and "did not finish within 2 s" in out["warnings"][0]
    for pid in map(int, pids.read_text().split()):
        with pytest.raises(ProcessLookupError):  # the compiler and its child are gone
            for _ in range(50):
                os.kill(pid, 0)
                time.sleep(0.1)


@needs_cc
@pytest.mark.parametrize("words", ["gcc -std=c11", "ccache gcc"])
def test_cc_of_several_words_is_split_as_a_shell_would(tmp_path: Path, words: str) -> None:
    """``CC="gcc -std=c11"`` or ``CC="ccache gcc"`` was "no C compiler found"."""
    log = tmp_path / "ccache.log"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _script(bin_dir / "ccache", f'echo "$@" >> {log}\nexec "$@"\n')
    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    env = _build_env(tmp_path, _private(tmp_path / "cache"), CC=words, PATH=path)
    out = _python(LOAD, env)
    assert out["origin"] == "built" and not out["warnings"], out
    if words.startswith("ccache"):
        assert "-ffp-contract=off" in log.read_text()


@needs_cc
def test_a_word_of_cc_reaches_the_compiler(tmp_path: Path) -> None:
    """The words after the compiler are its flags: ``-std=c89`` cannot compile the C (its
    ``restrict``), and the warning says so rather than "no compiler"."""
    env = _build_env(tmp_path, _private(tmp_path / "cache"), CC="gcc -std=c89 -pedantic-errors")
    out = _python(LOAD, env)
    assert out["origin"] == "unavailable"
    assert len(out["warnings"]) == 1 and "could not compile" in out["warnings"][0], out


# ------------------------------------------------------------------ folders others can write


def _planted(tmp_path: Path, marker: Path) -> Path:
    """A library whose constructor leaves ``marker``: running it is the attack."""
    source = tmp_path / "planted.c"
    source.write_text(
        "#include <stdio.h>\n"
        "__attribute__((constructor)) static void planted(void) {\n"
        f'    FILE *f = fopen("{marker}", "w");\n'
        '    if (f) { fputs("ran", f); fclose(f); }\n'
        "}\n"
        "int mp_abi_version(void) { return 4; }\n"
    )
    out = tmp_path / "planted.so"
    subprocess.run([GCC, "-shared", "-fPIC", "-o", str(out), str(source)], check=True)  # type: ignore[list-item]
    return out


@needs_cc
@needs_installed
def test_a_library_planted_in_a_folder_others_can_write_is_never_loaded(
    tmp_path: Path, seed_build: Path
) -> None:
    """Under the exact name the developer build would load, in a world-writable cache: the
    constructor never runs, with the developer build off (the installed library runs) or on
    (the folder is refused: a private temporary build, said once). The control: the same
    file in a private folder is loaded (it is the user's own file), so the name is right
    and only the check protects."""
    marker = tmp_path / "marker"
    planted = _planted(tmp_path, marker)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    target = shared / seed_build.name
    shutil.copy2(planted, target)
    target.chmod(0o755)
    (shared / "mixprec-native-0123456789abcdef01234567.so").write_bytes(planted.read_bytes())

    for env in (
        _env(tmp_path, MIXPREC_CACHE_DIR=str(shared)),
        _env(tmp_path, XDG_CACHE_HOME=str(tmp_path)),  # $XDG_CACHE_HOME/mixprec
    ):
        (tmp_path / "mixprec").mkdir(exist_ok=True)
        (tmp_path / "mixprec").chmod(0o777)
        shutil.copy2(planted, tmp_path / "mixprec" / seed_build.name)
        out = _python(STEP, env)
        assert out["origin"] == "installed" and out["native_updates"] > 0, out
        assert not out["warnings"] and not marker.exists()

    out = _python(LOAD, _build_env(tmp_path, shared))
    assert not marker.exists(), "the planted library's constructor ran"
    assert out["origin"] == "built" and not out["path"].startswith(str(shared)), out
    assert len(out["warnings"]) == 1 and "writable by others" in out["warnings"][0]
    assert "private folder" in out["warnings"][0]
    assert sorted(p.name for p in shared.iterdir()) == sorted(
        [seed_build.name, "mixprec-native-0123456789abcdef01234567.so"]
    ), "the build wrote into the shared folder"

    writable_file = _private(tmp_path / "private2")
    shutil.copy2(planted, writable_file / seed_build.name)
    (writable_file / seed_build.name).chmod(0o666)
    out = _python(LOAD, _build_env(tmp_path, writable_file))
    assert not marker.exists(), "a world-writable file was loaded"
    assert out["origin"] == "built" and "writable by others" in out["warnings"][0]

    linked = tmp_path / "linked"
    linked.symlink_to(_private(tmp_path / "real"))
    out = _python(LOAD, _build_env(tmp_path, linked))
    assert out["origin"] == "built" and "symbolic link" in out["warnings"][0], out

    control = _private(tmp_path / "control")
    shutil.copy2(planted, control / seed_build.name)
    (control / seed_build.name).chmod(0o700)
    out = _python(LOAD, _build_env(tmp_path, control))
    assert marker.exists(), "the control: a private file under that name is loaded"
    assert out["origin"] == "unavailable" and "lacks" in out["reason"]


# ------------------------------------------------------------------ the installed library


@needs_installed
def test_without_a_library_the_twin_runs_and_one_warning_says_how(tmp_path: Path) -> None:
    out = _python(STEP, _env(tmp_path), str(tmp_path / "none" / libfile.LIBRARY))
    assert out["origin"] == "unavailable" and out["native_updates"] == 0, out
    (said,) = out["warnings"]
    assert "is missing" in said and "wheel" in said and "MIXPREC_NATIVE=0" in said
    quiet = _python(STEP, _env(tmp_path, MIXPREC_NATIVE="0"))
    assert quiet["origin"] == "disabled" and not quiet["warnings"], quiet
    assert quiet["native_updates"] == 0
    assert quiet["weights"] == out["weights"]


@needs_installed
@pytest.mark.parametrize("mode", [0o775, 0o757], ids=["group-writable", "world-writable"])
def test_an_installed_library_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    folder = _private(tmp_path / "pkg")
    library = folder / libfile.LIBRARY
    shutil.copy2(clib.info().path, library)
    library.chmod(mode)
    out = _python(LOAD, _env(tmp_path), str(library))
    assert out["origin"] == "unavailable" and "writable by others" in out["reason"], out
    assert len(out["warnings"]) == 1
    library.chmod(0o755)
    folder.chmod(0o777)
    out = _python(LOAD, _env(tmp_path), str(library))
    assert out["origin"] == "unavailable" and "folder" in out["reason"], out
    folder.chmod(0o755)
    assert _python(LOAD, _env(tmp_path), str(library))["origin"] == "installed"


@needs_installed
def test_mixprec_native_0_and_the_twin_give_the_kernels_bits(
    tmp_path: Path,
    twin: dict,  # type: ignore[type-arg]
) -> None:
    kernels = _python(DIGEST, _env(tmp_path))
    assert kernels["status"].startswith("in use: installed"), kernels
    assert twin["status"] == "not in use: switched off by MIXPREC_NATIVE=0", twin
    assert kernels["digest"] == twin["digest"]


def test_mixprec_backends_says_where_the_kernels_come_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mixprec.cli import main

    def torch_lines() -> list[str]:
        monkeypatch.setattr(clib, "_state", {})
        assert main(["backends"]) == 0
        out = capsys.readouterr().out
        return [line.strip() for line in out.splitlines() if "CPU kernels:" in line]

    for name in ("MIXPREC_NATIVE", "MIXPREC_NATIVE_BUILD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MIXPREC_DISABLE_PLUGINS", "mxnet")  # MXNet's import is slow
    found = clib.info()
    (line,) = torch_lines()
    if found.origin == "installed":
        assert line.startswith(f"CPU kernels: in use: installed ({found.path}; ")
        assert found.isa in line
    monkeypatch.setenv("MIXPREC_NATIVE", "0")
    assert torch_lines() == ["CPU kernels: not in use: switched off by MIXPREC_NATIVE=0"]
    monkeypatch.delenv("MIXPREC_NATIVE")
    monkeypatch.setattr(loader, "_installed", lambda: tmp_path / libfile.LIBRARY)
    (line,) = torch_lines()
    assert line.startswith("CPU kernels: not in use: this install has no compiled library")
    if GCC is not None:
        monkeypatch.setenv("MIXPREC_NATIVE_BUILD", "1")
        monkeypatch.setenv("MIXPREC_CACHE_DIR", str(_private(tmp_path / "cache")))
        (line,) = torch_lines()
        assert line.startswith(f"CPU kernels: in use: built ({tmp_path / 'cache'}")


# ------------------------------------------------------------------ slow: wheel, ISAs, sanitizers


def _clone(tmp: Path) -> Path:
    """The working tree as a clean clone has it (no build output, no in-place library)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    copy = tmp / "clone"
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    assert not (copy / "backends/torch/cpu" / libfile.LIBRARY).exists()
    return copy


@pytest.mark.slow
@needs_cc
def test_a_wheel_carries_the_kernels_and_runs_them_without_a_compiler(tmp_path: Path) -> None:
    pip_env = _env(tmp_path, PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(wheels), str(_clone(tmp_path))],
        env=pip_env, check=True, capture_output=True, timeout=900,
    )  # fmt: skip
    (wheel,) = wheels.glob("mixprec-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert f"mixprec_torch/cpu/{libfile.LIBRARY}" in names, names
    assert "mixprec_torch/cpu/_cpu_kernels.c" in names
    assert not re.search(r"-py3-none-any\.whl$", wheel.name), "a wheel with a library is not pure"

    target = tmp_path / "target"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
         str(wheel)],
        env=pip_env, check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    empty = {name: tmp_path / name for name in ("home", "xdg", "cache", "bin", "work")}
    for folder in empty.values():
        folder.mkdir()
    env = _env(
        tmp_path,
        PATH=str(empty["bin"]),  # no cc, gcc or clang
        HOME=str(empty["home"]),
        XDG_CACHE_HOME=str(empty["xdg"]),
        MIXPREC_CACHE_DIR=str(empty["cache"]),
        PYTHONPATH=str(target),
        PYTHONNOUSERSITE="1",
        MIXPREC_TEST_CWD=str(empty["work"]),
    )
    out = _python(STEP, env)
    assert Path(out["module"]).is_relative_to(target), out["module"]
    assert out["origin"] == "installed" and out["path"].startswith(str(target.resolve())), out
    assert out["native_updates"] == 3 and not out["warnings"], out
    for name in ("home", "xdg", "cache"):
        assert not any(empty[name].rglob("*")), (
            f"{name} was written: {list(empty[name].rglob('*'))}"
        )


def _isa_build(tmp: Path, name: str, flags: str) -> dict[str, str]:
    return _build_env(
        tmp, _private(tmp / name), MIXPREC_NATIVE_CFLAGS=f"-DMP_NO_CLONES {flags}".strip()
    )


@pytest.mark.slow
@needs_cc
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the clones are x86-64's")
def test_each_isa_build_gives_the_twins_bits(tmp_path: Path, twin: dict) -> None:  # type: ignore[type-arg]
    """The clones are the same C compiled for each ISA: a build of one ISA alone (baseline,
    AVX2, and AVX-512 where this CPU runs it) and the build with the clones give the twin's
    bits. On a CPU without AVX-512 its build is compiled (and checked to carry AVX-512 code)
    but cannot run: re-run this test on an AVX-512 machine."""
    flags = Path("/proc/cpuinfo").read_text().split()
    builds = {"clones": _build_env(tmp_path, _private(tmp_path / "clones"))}
    builds["baseline"] = _isa_build(tmp_path, "baseline", "")
    builds["avx2"] = _isa_build(tmp_path, "avx2", "-mavx2")
    avx512 = _isa_build(tmp_path, "avx512f", "-mavx512f")
    if "avx512f" in flags:
        builds["avx512f"] = avx512
    else:
        env = dict(avx512, MIXPREC_NATIVE_BUILD="0")
        facts = libfile.source_facts()
        out = tmp_path / "avx512f.so"
        subprocess.run(
            [GCC, *facts.cflags, "-fPIC", "-shared", "-DMP_NO_CLONES", "-mavx512f",
             "-S", "-o", str(out.with_suffix(".s")), str(SOURCE)],
            env=env, check=True, capture_output=True,
        )  # fmt: skip
        assert "zmm" in out.with_suffix(".s").read_text()
    for name, env in builds.items():
        out = _python(DIGEST, env)
        expected = "baseline" if name == "baseline" else name
        assert out["status"].startswith("in use: built"), out
        if name != "clones":
            assert f"; {expected})" in out["status"], out["status"]
        assert out["digest"] == twin["digest"], f"the {name} build's bits differ from the twin's"


@pytest.mark.slow
@needs_cc
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD of libasan")
def test_the_kernel_tests_pass_under_the_sanitizers(tmp_path: Path) -> None:
    """``make sanitize``: the developer build with AddressSanitizer and UBSan (into
    build/sanitize), libasan preloaded (a ctypes-loaded ASan library needs its runtime
    first), and the kernel tests against it. A canary first: an out-of-bounds write in an ASan
    library loaded the same way must abort the process, so a green run means something."""

    def runtime(name: str) -> str:
        found = subprocess.run(
            [GCC, f"-print-file-name={name}"], capture_output=True, text=True, check=True
        ).stdout.strip()  # type: ignore[list-item]
        if not os.path.isabs(found):
            pytest.skip(f"gcc has no {name}")
        return found

    # libstdc++ too: torch loads it after ASan started, whose C++ exception interceptor then
    # finds no __cxa_throw ("CHECK failed: asan_interceptors.cpp")
    preload = f"{runtime('libasan.so')} {runtime('libstdc++.so')}"
    flags = "-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
    # the reports go to files: pytest's capture would swallow what a dying process printed
    sanitized = {
        "ASAN_OPTIONS": f"detect_leaks=0:log_path={tmp_path / 'asan'}",
        "UBSAN_OPTIONS": f"print_stacktrace=1:log_path={tmp_path / 'ubsan'}",
        "LD_PRELOAD": preload,
    }
    canary = tmp_path / "canary.c"
    canary.write_text(
        "#include <stdlib.h>\n"
        "int poke(int n) { int *a = malloc(4 * sizeof(int)); a[n] = 1; int v = a[0]; "
        "free(a); return v; }\n"
    )
    subprocess.run(
        [GCC, *flags.split(), "-shared", "-fPIC", "-o", str(tmp_path / "canary.so"), str(canary)],
        check=True,
    )  # type: ignore[list-item]
    poke = f"import ctypes; ctypes.CDLL({str(tmp_path / 'canary.so')!r}).poke(4)"
    done = subprocess.run(
        [sys.executable, "-c", poke], env=_env(tmp_path, **sanitized), capture_output=True,
        text=True, check=False,
    )  # fmt: skip
    reports = "".join(p.read_text() for p in tmp_path.glob("asan.*"))
    assert done.returncode != 0 and "heap-buffer-overflow" in reports, done.stderr[-2000:]
    for report in tmp_path.glob("asan.*"):
        report.unlink()

    cache = ROOT / "build" / "sanitize"
    env = _build_env(tmp_path, cache, MIXPREC_NATIVE_CFLAGS=flags, **sanitized)
    status = subprocess.run(
        [sys.executable, "-c", "from mixprec_torch.cpu import clib; print(clib.status())"],
        env=env, cwd=ROOT, capture_output=True, text=True, check=True, timeout=300,
    ).stdout.strip()  # fmt: skip
    assert status.startswith(f"in use: built ({cache}"), status
    library = Path(status.split("(", 1)[1].split(";", 1)[0])
    assert b"libasan" in library.read_bytes() and b"libubsan" in library.read_bytes()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/torch/test_cpu_kernels.py", "tests/torch/test_lowbit_native.py"],
        env=env, cwd=ROOT, capture_output=True, text=True, check=False, timeout=1500,
    )  # fmt: skip
    reports = "".join(p.read_text() for p in tmp_path.glob("*san.*"))
    tail = run.stdout[-3000:] + run.stderr[-3000:] + reports[-6000:]
    assert run.returncode == 0 and not reports, tail
    assert "runtime error" not in run.stdout + run.stderr, tail
    summary = run.stdout.strip().splitlines()[-1]
    assert "passed" in summary and "skipped" not in summary and "failed" not in summary, summary


@pytest.fixture(autouse=True)
def _no_leftover_state() -> Iterator[None]:
    """These tests run the loader in other processes; this one keeps its library."""
    before = dict(clib._state)
    yield
    clib._state.clear()
    clib._state.update(before)
