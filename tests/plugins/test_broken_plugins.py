"""Broken third-party plugins are reported by name and do not break the other backends.

Each broken plugin is a real distribution (a ``.dist-info`` with a ``mixprec`` entry point)
in a temporary directory put on ``PYTHONPATH`` of a fresh interpreter, as after
``pip install``.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("mixprec_numpy", reason="pip install -e ./plugins/mixprec-numpy")

BROKEN = {
    # entry-point name: (module name, module source, what the report must say)
    "fails-to-import": (
        "mixprec_fails_to_import",
        "import mixprec_no_such_dependency_xyz\n",
        "mixprec_no_such_dependency_xyz",
    ),
    "wrong-signature": (
        "mixprec_wrong_signature",
        """
        from mixprec.engine.hookspecs import hookimpl

        @hookimpl
        def mixprec_register_backends(config):
            return []
        """,
        "config",
    ),
    "raises-on-register": (
        "mixprec_raises_on_register",
        """
        from mixprec.engine.hookspecs import hookimpl

        @hookimpl
        def mixprec_register_backends():
            raise RuntimeError("cannot declare my backend")
        """,
        "cannot declare my backend",
    ),
}


def _install(site: Path, plugin: str, module: str, source: str) -> None:
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    dist = site / f"{module}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[mixprec]\n{plugin} = {module}\n")


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("site")
    for plugin, (module, source, _) in BROKEN.items():
        _install(site, plugin, module, source)
    environ = dict(os.environ)
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), environ.get("PYTHONPATH")]))
    environ.pop("MIXPREC_DISABLE_PLUGINS", None)
    return environ


def _python(env: dict[str, str], code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_broken_plugins_are_reported_and_the_others_work(env: dict[str, str]) -> None:
    out = _python(
        env,
        textwrap.dedent("""
        import json
        from mixprec.engine.plugins import load_backend
        from mixprec.engine.plugins import broken_plugins, list_backends
        rows = {row.info.name: row.usable for row in list_backends()}
        caps = load_backend("numpy").capabilities().device("cpu").compute_dtypes
        print(json.dumps({"rows": rows, "broken": broken_plugins(), "numpy": caps}))
    """),
    )
    report = json.loads(out)
    assert set(report["broken"]) == set(BROKEN)
    for plugin, (_, _, says) in BROKEN.items():
        assert says in report["broken"][plugin]
    assert report["rows"] == {"torch": True, "mxnet": True, "numpy": True}
    assert report["numpy"] == ["float32", "float16", "bfloat16"]


def test_cli_lists_numpy_with_capabilities_and_names_broken_plugins(env: dict[str, str]) -> None:
    env = {**env, "MIXPREC_DISABLE_PLUGINS": "torch,mxnet"}  # keep the frameworks unimported
    out = _python(env, "from mixprec.cli import main; raise SystemExit(main(['backends']))")
    assert f"numpy    numpy {importlib.metadata.version('numpy')}  (plugin numpy)" in out
    numpy_row = out.split("numpy ", 1)[1]
    assert "cpu: float32, float16, bfloat16" in numpy_row.split("broken plugins", 1)[0]
    broken = out.split("broken plugins:", 1)[1]
    assert all(f"  {plugin}: " in broken for plugin in BROKEN)
