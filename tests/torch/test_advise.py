"""The precision advisor on PyTorch: the fragile module is named and fixed, the user's model,
optimizer and random state are untouched, the report's files and the CLI work.

float16 on a CPU is slow, so the fp16 cases use tiny tensors and a handful of steps.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import mixprec  # noqa: E402
import mixprec.torch as mpt  # noqa: E402
from mixprec.cli import main  # noqa: E402
from mixprec.kit import AdviceError  # noqa: E402


class FragileNorm(nn.Module):
    """Normalises by an RMS taken on a x300 copy: (300 x)^2 overflows float16 (max 65504)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        big = x * 300.0
        return big / (big * big).mean(dim=-1, keepdim=True).sqrt()


def fragile_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), FragileNorm(), nn.Linear(16, 4))


def tiny_batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [
        (torch.randn(4, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen))
        for _ in range(n)
    ]


def sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.005, momentum=0.9)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def fragile_report() -> mixprec.advisor.report.AdviceReport:
    return mpt.advise(
        fragile_net(), sgd, tiny_batches(), nn.functional.cross_entropy, ["O2"], 6, progress=False
    )


def test_fragile_module_is_named_first_and_its_rule_fixes_it(fragile_report) -> None:  # type: ignore[no-untyped-def]
    report = fragile_report
    worst = report.sensitivity[0]
    assert (worst.module, worst.module_class) == ("2", "FragileNorm")
    assert worst.added_error > report.threshold
    assert all(s.added_error <= report.threshold for s in report.sensitivity[1:])
    assert report.rules == ["path:2=float32"]
    assert report.tuned_policy == "base=O2,path:2=float32"
    # the rule's effect: every module under threshold, and the loss follows float32 again
    assert all(s.added_error <= report.threshold for s in report.tuned_sensitivity)
    plain, tuned = report.run("O2"), report.run(report.tuned_policy)
    assert tuned.ok and tuned.loss_distance is not None and plain.loss_distance is not None
    assert tuned.loss_distance < report.tolerance < plain.loss_distance
    assert "path:2=float32" in report.table()


def test_recommendation_and_tuned_policy_round_trip_through_get_policy(
    fragile_report, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    report = fragile_report
    for spec in (report.recommended, report.tuned_policy):
        assert str(mixprec.get_policy(spec)) == spec
    assert report.recommended != "O2"  # its loss left float32's: never recommended
    toml = report.write_toml(tmp_path / "policy.toml")
    assert mixprec.load_toml(toml) == mixprec.get_policy(report.recommended)
    data = json.loads(report.to_json())
    policies = [r["policy"] for r in data["runs"]]
    assert policies[:3] == ["O0", "O2", "base=O2,path:2=float32"]
    # then the int8 twins of float32 and of the first recommendation (test_advise_lowbit.py)
    assert policies[3] == "O0,state=int8"
    assert all(r["state_twin"] for r in data["runs"][3:]) and len(policies) <= 5
    assert data["recommended"] == report.recommended


def test_every_run_reports_times_memory_scale_and_distance(fragile_report) -> None:  # type: ignore[no-untyped-def]
    for run in fragile_report.runs:
        assert run.ok, run.status
        assert len(run.losses) == len(run.loss_scales) == 6
        assert len(run.step_times) == 4  # two warm-up steps are not timed
        assert run.peak_memory is not None and run.underflow_fraction is not None
        assert run.state_bytes_per_param == 4.0  # SGD's float32 momentum (no tensor is int8)
    assert fragile_report.run("O0").loss_scales == [1.0] * 6
    assert fragile_report.run("O2").loss_scales[0] == 65536.0  # dynamic scaling, float16
    assert fragile_report.run("O0").loss_distance == 0.0
    assert "RSS" in fragile_report.memory_measure


class Overflowing(nn.Module):
    """Issue 24's model: the Linear ``big`` puts out ~1e5, beyond float16's 65504, so O1 is
    NaN from the first step; with ``path:big=float32`` it trains like float32, except that
    its gradients overflow float16 at the scaler's first scale (65536): like any float16 run,
    the dynamic scale backs off twice (to 16384) before its first step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.big, self.norm, self.head = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)
        with torch.no_grad():
            self.big.weight.mul_(3e5)
            self.norm.weight.mul_(4.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.big(x)))


def test_fp16_with_the_rule_is_recommended_when_its_only_skips_are_the_warm_up() -> None:
    report = mpt.advise(Overflowing(), sgd, tiny_batches(), nn.functional.cross_entropy,
                        candidates=["O1"], steps=4, progress=False,
                        objective="numerics")  # fmt: skip
    tuned = "base=O1,path:big=float32"
    assert report.rules == ["path:big=float32"] and report.tuned_policy == tuned
    # judged on its numerics: the scaler's warm-up ran before the run and is not a skip
    run = report.run(tuned)
    assert (run.warmup_skips, run.initial_scale, run.skipped_steps) == (2, 16384.0, 0)
    assert run.loss_scales == [16384.0] * 4 and run.loss_distance is not None
    assert run.loss_distance < 0.01 * report.tolerance
    # numerics: fp16 with the rule, whether or not fp16 is fast here
    assert report.recommended == tuned and report.objective == "numerics"
    assert report.safest == tuned and report.fastest in ("O0", tuned)
    # every run says why it lost, in the table, the JSON and the plots' labels
    assert run.verdict == "recommended"
    assert report.run("O1").verdict.startswith("rejected: its loss went inf/NaN")
    assert report.run("O0").verdict.startswith("float32 reference")
    table = report.table()
    for text in ("warm-up: " + tuned + ": 4 calibration steps before the run, 2 skipped",
                 "0 (+2 warm-up)", "rejected: its loss went inf/NaN", "recommended: " + tuned,
                 "fastest here: ", "safest numerics: " + tuned):  # fmt: skip
        assert text in table, text
    data = json.loads(report.to_json())
    assert [r["verdict"] for r in data["runs"]] == [r.verdict for r in report.runs]
    assert (data["recommended"], data["safest"]) == (tuned, tuned)


def test_users_model_optimizer_and_random_state_are_untouched() -> None:
    model = fragile_net()
    optimizer = sgd(model.parameters())
    batches = tiny_batches(2)
    nn.functional.cross_entropy(model(batches[0][0]), batches[0][1]).backward()
    optimizer.step()  # the user's optimizer has momentum state and the model has gradients
    params = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    opt_state = {k: v["momentum_buffer"].clone() for k, v in optimizer.state.items()}  # type: ignore[index]
    groups = [dict(g, params=None) for g in optimizer.param_groups]
    rng = torch.get_rng_state()

    mpt.advise(model, sgd, batches, nn.functional.cross_entropy, ["O1-bf16"], 3, progress=False)

    assert all(torch.equal(v, params[k]) for k, v in model.state_dict().items())
    assert all(v.dtype == torch.float32 for v in model.state_dict().values())
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))  # type: ignore[arg-type]
    assert [dict(g, params=None) for g in optimizer.param_groups] == groups
    assert all(torch.equal(optimizer.state[p]["momentum_buffer"], b) for p, b in opt_state.items())
    assert not hasattr(model, "_mixprec") and type(optimizer) is torch.optim.SGD
    assert torch.equal(torch.get_rng_state(), rng)


def test_bad_arguments_are_refused_before_anything_runs() -> None:
    model = fragile_net()
    batches = tiny_batches(1)
    loss = nn.functional.cross_entropy
    with pytest.raises(AdviceError, match="lambda params"):
        mpt.advise(model, sgd(model.parameters()), batches, loss)  # an optimizer, not a factory
    with pytest.raises(mixprec.PolicyError, match="O7"):
        mpt.advise(model, sgd, batches, loss, ["O7"], 2)
    with pytest.raises(AdviceError, match="empty"):
        mpt.advise(model, sgd, [], loss)


def test_cli_advise_prints_the_table_and_writes_report_and_plots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "tiny_advice_case.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            def factory():
                torch.manual_seed(0)
                model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
                batches = [(torch.randn(4, 8), torch.randint(0, 2, (4,))) for _ in range(2)]
                make_optimizer = lambda p: torch.optim.SGD(p, lr=0.1)
                return model, make_optimizer, batches, nn.functional.cross_entropy
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "advice"
    code = main(["advise", "tiny_advice_case:factory", "--candidates", "O1-bf16", "--steps", "3",
                 "--out", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0
    assert (
        "O1-bf16" in printed and "recommended:" in printed and str(out / "report.json") in printed
    )
    for name in ("report.json", "recommended.toml", "time_vs_distance.png", "sensitivity.png"):
        assert (out / name).stat().st_size > 0
    assert main(["advise", "no_such_module_here:factory"]) == 2
    assert "cannot import" in capsys.readouterr().err


def test_loss_distance_is_inf_when_a_candidate_diverges() -> None:
    report = mpt.advise(
        fragile_net(), sgd, tiny_batches(), nn.functional.cross_entropy, ["O3"], 3,
        max_rules=0, progress=False,
    )  # fmt: skip
    o3 = report.run("O3")  # pure float16 without loss scaling: the fragile norm gives NaN
    assert o3.loss_distance is not None and (
        math.isinf(o3.loss_distance) or o3.loss_distance > 0.05
    )
    assert report.recommended == "O0"


def test_demo_advisor_writes_non_empty_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "examples" / "advise_demo.py"
    spec = importlib.util.spec_from_file_location("advise_demo", path)
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    paths = demo.advise_backend("torch", tmp_path, steps=2, candidates=["O2-bf16"], progress=False)
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["loss_curves.png", "loss_scale.png", "sensitivity.png", "time_vs_distance.png"]
    for png in tmp_path.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert json.loads(paths["json"].read_text())["backend"] == "torch"
    assert "O2-bf16" in capsys.readouterr().out


DOCS = Path(__file__).resolve().parents[2] / "docs" / "advisor.md"


def _docs_block(marker: str) -> str:
    """The fenced block right after ``<!-- advisor: MARKER -->`` on the advisor page."""
    text = DOCS.read_text(encoding="utf-8")
    after = text.split(f"<!-- advisor: {marker} -->", 1)[1]
    return after.split("```python\n", 1)[1].split("\n```", 1)[0] + "\n"


def _mixprec(*args: str, cwd: Path, pre: str = "") -> subprocess.CompletedProcess[str]:
    """``mixprec ARGS`` in a fresh process, output piped, as a user's shell runs it."""
    code = f"{pre}import sys\nfrom mixprec.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600, check=False)  # fmt: skip


@pytest.mark.slow
def test_the_pages_pytorch_script_runs_as_written(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(_docs_block("torch snippet"))
    proc = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "recommended: " in proc.stdout and "objective: speed" in proc.stdout
    assert (tmp_path / "advice" / "recommended.toml").is_file()


@pytest.mark.slow
def test_the_pages_factory_file_runs_under_the_command(tmp_path: Path) -> None:
    """The page's complete my_advice.py, written by the user in their folder, run by the
    command the page shows: piped, a line per candidate; only mixprec's own lines."""
    (tmp_path / "my_advice.py").write_text(_docs_block("factory my_advice.py"))
    proc = _mixprec("advise", "my_advice:factory", "--candidates", "O1-bf16,O2-bf16",
                    "--steps", "4", "--out", "advice/", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "recommended: " in proc.stdout and "advice/report.json" in proc.stdout
    lines = proc.stderr.splitlines()
    for n, policy in enumerate(("O0", "O1-bf16", "O2-bf16"), 1):
        assert any(line.startswith(f"advise torch: [{n}/3] {policy}: ") for line in lines)
    # nothing but the advisor's progress lines: no warnings of the copies, no framework logs
    assert all(line.startswith("advise torch: ") for line in lines), lines
    assert sorted(p.name for p in (tmp_path / "advice").glob("*.png")) == [
        "loss_curves.png", "loss_scale.png", "sensitivity.png", "time_vs_distance.png",
    ]  # fmt: skip


def test_a_bad_out_is_refused_before_any_training(tmp_path: Path) -> None:
    (tmp_path / "my_advice.py").write_text(
        "def factory():\n    raise SystemExit('the factory ran: training would follow')\n"
    )
    (tmp_path / "notes.txt").write_text("a file")
    for out, said in (("notes.txt/advice", "is under notes.txt, a file"),
                      ("notes.txt", "is a file")):  # fmt: skip
        proc = _mixprec("advise", "my_advice:factory", "--out", out, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith(f"mixprec: error: --out {out!r} {said}, not a folder")
        assert "factory ran" not in proc.stderr + proc.stdout
    assert (tmp_path / "notes.txt").read_text() == "a file"


@pytest.mark.slow
def test_without_matplotlib_the_run_says_so_at_its_start_and_writes_no_plots(
    tmp_path: Path,
) -> None:
    (tmp_path / "my_advice.py").write_text(_docs_block("factory my_advice.py"))
    proc = _mixprec("advise", "my_advice:factory", "--candidates", "O1-bf16", "--steps", "3",
                    "--out", "advice", cwd=tmp_path,
                    pre="import sys\nsys.modules['matplotlib'] = None\n")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = proc.stderr.splitlines()[0]
    assert first.startswith("mixprec: warning: matplotlib is not installed, so this run writes")
    assert "pip install 'mixprec[advise]'" in first
    assert (tmp_path / "advice" / "report.json").is_file()
    assert not list((tmp_path / "advice").glob("*.png"))
    assert "plots:  none (pip install 'mixprec[advise]')" in proc.stdout


def test_advise_help_names_no_file_of_a_clone() -> None:
    proc = _mixprec("advise", "--help", cwd=Path.cwd())
    assert proc.returncode == 0
    assert "examples.advise_demo" not in proc.stdout and "my_advice:factory" in proc.stdout
    assert "--objective {speed,memory,numerics}" in proc.stdout
