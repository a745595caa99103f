"""``python -m benchmarks.mutation``: a small mutation tester for mixprec's core modules.

Each *mutant* is the module with one small change (an operator, a comparison, a constant, a
boolean connective, a deleted call, ``raise`` or attribute assignment, a return value made
None); the tests "kill" it when they fail. A mutant that survives names a behaviour no test
pins down. The mutation score is killed / all mutants. docs/reliability.md records the
scores and the command.

Example (everything after ``--`` goes to pytest)::

    python -m benchmarks.mutation mixprec/numerics/loss_scale.py --jobs 2 -- \\
        tests/core/test_loss_scale.py tests/core/test_scaler.py -m "not torch"

How it runs: the module's package (``mixprec``, or a backend or plugin: ``mixprec_torch``
from ``backends/torch``, ``mixprec_mxnet``, ``mixprec_numpy``, ``mixprec_jax``, the last
run with the JAX venv's Python) is copied into a temporary folder (one copy per job);
for each mutant the copy's module is overwritten and a forked child (this process imported
pytest, never mixprec) puts the copy first on ``sys.path`` and runs pytest on the given
tests (``-x``: the first failure kills the mutant), with bytecode caching off so a rewritten
file is never read from a stale ``.pyc``. A mutant still running after three times the
unmutated run is stopped and, at the end, run again with four times that limit: only a
second timeout counts it as killed (an endless loop), not a loaded machine. An unmutated
run comes first and must pass. Left out, as they change nothing a test could see:
docstrings, annotations, ``__all__``, ``TYPE_CHECKING`` blocks, and the text of error and
warning messages (a mutant there survives by design, so they would only dilute the score).
Not made: ``None`` -> ``0`` where ``None`` is an operand of ``is``/``is not`` (``x is 0`` is
a SyntaxWarning, an error under the suite's warning filters: the mutant never imports and
would count as killed whatever the tests do; ``is`` -> ``is not`` is made there instead).
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Where each package's source lives in the clone, and the name it is imported by.
PACKAGES: dict[Path, str] = {
    ROOT / "mixprec": "mixprec",
    ROOT / "backends" / "torch": "mixprec_torch",
    ROOT / "backends" / "mxnet": "mixprec_mxnet",
    ROOT / "plugins" / "mixprec-numpy" / "src" / "mixprec_numpy": "mixprec_numpy",
    ROOT / "plugins" / "mixprec-jax" / "src" / "mixprec_jax": "mixprec_jax",
}


def package_of(module: Path) -> tuple[Path, str]:
    """The source folder of the package ``module`` belongs to, and its import name."""
    path = module.resolve()
    for folder, name in PACKAGES.items():
        if path.is_relative_to(folder):
            return folder, name
    raise SystemExit(f"{module} is in none of mixprec's packages: {', '.join(PACKAGES.values())}")


_SWAP_BINOP: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Div,
    ast.Mod: ast.Mult,
    ast.Pow: ast.Mult,
}
_SWAP_CMP: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
_MESSAGE_CALLS = {"warn", "PolicyError", "CheckpointError", "LossScaleError", "ValueError"}


@dataclass
class Mutant:
    """One change: its index among the module's mutation sites, line and description."""

    index: int
    line: int
    what: str
    status: str = "pending"


Mutation = Callable[[ast.AST], ast.AST | None]


def _call_name(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _skipped_subtrees(tree: ast.Module) -> set[int]:
    """ids of nodes whose mutation changes nothing observable (see the module docstring)."""
    skip: set[int] = set()

    def drop(node: ast.AST | None) -> None:
        if node is not None:
            skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            drop(body[0])
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            drop(node)  # attribute docstrings
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            drop(node.returns)
            for arg in [*node.args.args, *node.args.kwonlyargs, *node.args.posonlyargs]:
                drop(arg.annotation)
            for arg in (node.args.vararg, node.args.kwarg):
                if arg is not None:
                    drop(arg.annotation)
        if isinstance(node, ast.AnnAssign):
            drop(node.annotation)
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            drop(node)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            drop(node)
        if isinstance(node, (ast.ImportFrom, ast.Import)):
            drop(node)
        if isinstance(node, ast.JoinedStr):
            drop(node)
        if isinstance(node, ast.Compare) and any(
            isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops
        ):
            for operand in (node.left, *node.comparators):
                if isinstance(operand, ast.Constant) and operand.value is None:
                    drop(operand)  # None -> 0 there is a SyntaxWarning, not a behaviour
        if isinstance(node, ast.Call) and _call_name(node) in _MESSAGE_CALLS:
            for arg in node.args[:1]:  # the message; the category of warn() stays mutable
                drop(arg)
    return skip


def _mutations(node: ast.AST) -> Iterator[tuple[str, Mutation]]:
    """The mutations of one node: (description, function returning the replacement)."""
    if isinstance(node, ast.BinOp) and type(node.op) in _SWAP_BINOP:
        new = _SWAP_BINOP[type(node.op)]

        def binop(n: ast.AST, new: type[ast.operator] = new) -> ast.AST:
            assert isinstance(n, ast.BinOp)
            n.op = new()
            return n

        yield f"{type(node.op).__name__} -> {new.__name__}", binop
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in _SWAP_CMP:
                swap = _SWAP_CMP[type(op)]

                def compare(n: ast.AST, i: int = i, swap: type[ast.cmpop] = swap) -> ast.AST:
                    assert isinstance(n, ast.Compare)
                    n.ops[i] = swap()
                    return n

                yield f"{type(op).__name__} -> {swap.__name__}", compare
    if isinstance(node, ast.BoolOp):
        other = ast.Or if isinstance(node.op, ast.And) else ast.And

        def boolop(n: ast.AST, other: type[ast.boolop] = other) -> ast.AST:
            assert isinstance(n, ast.BoolOp)
            n.op = other()
            return n

        yield f"{type(node.op).__name__} -> {other.__name__}", boolop
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        yield f"drop {type(node.op).__name__}", lambda n: n.operand  # type: ignore[attr-defined]
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool):
            yield f"{value} -> {not value}", lambda n: ast.Constant(not value)
        elif isinstance(value, int):
            yield f"{value} -> {value + 1}", lambda n: ast.Constant(value + 1)
        elif isinstance(value, float):
            other_value = value * 2 if value else 1.0
            yield f"{value!r} -> {other_value!r}", lambda n: ast.Constant(other_value)
        elif isinstance(value, str) and len(value) <= 24:
            yield f"{value!r} -> 'XX'", lambda n: ast.Constant("XX")
        elif value is None:
            yield "None -> 0", lambda n: ast.Constant(0)
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        yield f"delete call {_call_name(node.value)}()", lambda n: ast.Pass()
    if isinstance(node, ast.Raise):
        yield "delete raise", lambda n: ast.Pass()
    if isinstance(node, ast.Assign) and all(isinstance(t, ast.Attribute) for t in node.targets):
        yield "delete attribute assignment", lambda n: ast.Pass()
    if isinstance(node, ast.Return) and node.value is not None:
        yield "return None", lambda n: ast.Return(ast.Constant(None))


def _sites(tree: ast.Module) -> list[tuple[int, int, str]]:
    """(node position in ast.walk order, line, description) for every mutation."""
    skip = _skipped_subtrees(tree)
    out = []
    for position, node in enumerate(ast.walk(tree)):
        if id(node) in skip:
            continue
        for what, _ in _mutations(node):
            out.append((position, getattr(node, "lineno", 0), what))
    return out


def mutants(source: str) -> list[Mutant]:
    """Every mutant of ``source``, in order."""
    sites = _sites(ast.parse(source))
    return [Mutant(i, line, what) for i, (_, line, what) in enumerate(sites)]


def function_lines(source: str, names: list[str]) -> set[int]:
    """The lines of the functions (or methods) named ``names`` in ``source``."""
    lines: set[int] = set()
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in names:
            found.add(node.name)
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    missing = sorted(set(names) - found)
    if missing:
        raise SystemExit(f"no function named {', '.join(missing)} in the module")
    return lines


def mutated_source(source: str, index: int) -> str:
    """``source`` with mutant ``index`` applied."""
    tree = ast.parse(source)
    position, _, what = _sites(tree)[index]
    target = list(ast.walk(tree))[position]
    change = dict(_mutations(target))[what]
    replacement = change(copy.deepcopy(target))
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if value is target:
                setattr(parent, field, replacement)
                return ast.unparse(ast.fix_missing_locations(tree))
            if isinstance(value, list):
                for i, item in enumerate(value):
                    if item is target:
                        value[i] = replacement
                        return ast.unparse(ast.fix_missing_locations(tree))
    raise AssertionError(f"mutation site {index} not found")


def _start(package: Path, tests: list[str]) -> int:
    """Fork a child that runs pytest on ``tests`` with ``package`` first on the path; the
    parent has imported pytest (and never mixprec), so a child starts in milliseconds."""
    pid = os.fork()
    if pid:
        return pid
    try:  # the child: quiet, fresh imports of mixprec from the mutated copy
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        sys.path.insert(0, str(package.parent))
        os.environ["PYTHONPATH"] = str(package.parent)  # subprocesses the tests start too
        os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
        os.chdir(ROOT)
        code = pytest.main(["-x", "-q", "-p", "no:cacheprovider", *tests])
    except BaseException:
        code = 99
    os._exit(int(code))


def _wait(pid: int, deadline: float) -> str:
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return "survived" if os.waitstatus_to_exitcode(status) == 0 else "killed"
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout"  # an endless loop counts as killed
        time.sleep(0.05)


def run(
    module: Path,
    tests: list[str],
    jobs: int,
    only: list[int] | None,
    functions: list[str] | None = None,
) -> list[Mutant]:
    """Run every mutant of ``module`` (a file of one of :data:`PACKAGES`) against ``tests``."""
    source = module.read_text(encoding="utf-8")
    todo = mutants(source)
    if only is not None:
        todo = [m for m in todo if m.index in only]
    if functions:
        inside = function_lines(source, functions)
        todo = [m for m in todo if m.line in inside]
    folder, name = package_of(module)
    relative = module.resolve().relative_to(folder)
    work = Path(tempfile.mkdtemp(prefix="mixprec-mutants-"))
    free = []
    for slot in range(jobs):
        package = work / str(slot) / name
        shutil.copytree(folder, package, ignore=shutil.ignore_patterns("__pycache__"))
        free.append(package)
    sys.dont_write_bytecode = True  # a rewritten file must never be read from a stale .pyc
    try:
        started = time.monotonic()
        if _wait(_start(free[0], tests), started + 1800) != "survived":
            raise SystemExit("the unmutated module fails these tests: fix that first")
        timeout = max(30.0, 3 * (time.monotonic() - started))
        queue = list(todo)
        running: dict[int, tuple[Mutant, Path, float]] = {}
        while queue or running:
            while queue and free:
                mutant, package = queue.pop(0), free.pop()
                (package / relative).write_text(
                    mutated_source(source, mutant.index), encoding="utf-8"
                )
                pid = _start(package, tests)
                running[pid] = (mutant, package, time.monotonic() + timeout)
            for pid, (mutant, package, deadline) in list(running.items()):
                done, status = os.waitpid(pid, os.WNOHANG)
                if not done and time.monotonic() <= deadline:
                    continue
                if done:
                    code = os.waitstatus_to_exitcode(status)
                    mutant.status = "survived" if code == 0 else "killed"
                else:
                    mutant.status = _wait(pid, deadline)
                del running[pid]
                (package / relative).write_text(source, encoding="utf-8")
                free.append(package)
                print(f"{mutant.status:>8}  line {mutant.line:4}  {mutant.what}", flush=True)
            time.sleep(0.05)
        package = free[0]
        for mutant in [m for m in todo if m.status == "timeout"]:  # a loaded machine, or a loop?
            (package / relative).write_text(mutated_source(source, mutant.index), encoding="utf-8")
            mutant.status = _wait(_start(package, tests), time.monotonic() + 4 * timeout)
            (package / relative).write_text(source, encoding="utf-8")
            print(f"{mutant.status:>8}  line {mutant.line:4}  {mutant.what} (again)", flush=True)
        return todo
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    split = args_in.index("--") if "--" in args_in else len(args_in)
    ours, tests = args_in[:split], args_in[split + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.mutation",
        usage="%(prog)s MODULE [options] -- TESTS [pytest options]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("module", type=Path, help="a module of mixprec, a backend or a plugin")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once")
    parser.add_argument("--only", type=int, nargs="*", help="run only these mutant indices")
    parser.add_argument(
        "--function",
        action="append",
        dest="functions",
        help="mutate only inside this function or method (repeatable)",
    )
    parser.add_argument(
        "--preload",
        action="append",
        default=[],
        help="import this third-party module once before forking (e.g. torch), so each "
        "mutant's run does not pay for it",
    )
    parser.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    parser.add_argument("--json", type=Path, help="write every mutant's result here")
    args = parser.parse_args(ours)
    if args.list:
        source = args.module.read_text(encoding="utf-8")
        inside = function_lines(source, args.functions) if args.functions else None
        for m in mutants(source):
            if inside is None or m.line in inside:
                print(f"{m.index:4}  line {m.line:4}  {m.what}")
        return 0
    if not tests:
        parser.error("give the tests to run after --")
    for name in args.preload:
        if name.split(".")[0].startswith("mixprec"):
            parser.error("--preload takes third-party modules: mixprec must come from the copy")
        importlib.import_module(name)
    results = run(args.module, tests, args.jobs, args.only, args.functions)
    killed = sum(m.status in ("killed", "timeout") for m in results)
    print(f"\n{args.module}: {killed}/{len(results)} mutants killed")
    for m in results:
        if m.status == "survived":
            print(f"  survived #{m.index}  line {m.line}  {m.what}")
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(m) for m in results], indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
