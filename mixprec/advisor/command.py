"""``mixprec advise module:factory``: the precision advisor from the command line.

The factory is a function of no arguments in an importable module. It returns
``(model, make_optimizer, batches, loss_fn)`` for PyTorch, and
``(net, (optimizer, optimizer_params), batches, loss_fn)`` for MXNet Gluon; the backend is
told by the model's class (or ``--backend``). The report goes to the terminal and, with the
recommended policy as TOML and the plots, into ``--out``.

What can fail after the training is checked before it: ``--out`` must be a folder this user
can write (or one it can create), and without matplotlib the run says at its start that it
writes no plots (``pip install 'mixprec[advise]'`` brings them).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from mixprec.advisor.verdicts import DEFAULT_STATES, OBJECTIVES, check_states
from mixprec.cli_format import positive_int
from mixprec.engine.plugins import load_backend
from mixprec.errors import AdviceError, MixprecWarning
from mixprec.policy.grammar import split_items

__all__ = [
    "add_parser",
    "backend_of",
    "check_out",
    "load_factory",
    "split_candidates",
    "split_states",
]


def load_factory(spec: str) -> Any:
    """The callable named by ``"package.module:function"``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise AdviceError(f"expected module:factory such as 'my_advice:factory', got {spec!r}")
    sys.path.insert(0, str(Path.cwd()))  # as `python -m` does: the current folder's modules
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise AdviceError(
            f"cannot import {module_name!r} ({exc}); run from the folder that holds it, "
            "or install it"
        ) from exc
    finally:
        sys.path.remove(str(Path.cwd()))
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise AdviceError(f"{module_name!r} has no function {attr!r}")
    return factory


def split_candidates(text: str) -> list[str]:
    """The policies of ``--candidates``: ``;`` always separates; within a part, each bare
    name (a preset, a ``.toml`` path) starts a policy and ``key=value`` items belong to the
    policy before them, so ``"O1-bf16,O2-bf16"`` is two policies and
    ``"base=O2-bf16,compute=bfloat16"`` or ``"O2-bf16,compute=float32"`` one (the key
    grammar's own commas)."""
    out: list[str] = []
    for part in text.split(";"):
        current: list[str] = []
        for item in split_items(part):
            if "=" not in item and current:
                out.append(",".join(current))
                current = []
            current.append(item)
        if current:
            out.append(",".join(current))
    if not out:
        raise AdviceError(f"--candidates {text!r} names no policy; e.g. 'O1-bf16,O2-bf16'")
    return out


def split_states(text: str) -> list[str]:
    """The formats of ``--states``: comma-separated (a format's own settings in parentheses
    stay whole: ``"int8,int4(min_size=0)"``); ``"none"`` offers none.

    :raises AdviceError: an item that names no low-bit state format.
    """
    return check_states(split_items(text))


def backend_of(model: Any) -> str:
    """``"torch"`` or ``"mxnet"``, from the packages the model's classes come from."""
    for cls in type(model).__mro__:
        root = cls.__module__.split(".")[0]
        if root in ("torch", "mxnet"):
            return root
    raise AdviceError(
        f"cannot tell the backend of a {type(model).__name__}; pass --backend torch or mxnet"
    )


def check_out(out: str) -> Path:
    """``--out`` as a path, refused (:class:`AdviceError`) unless it is a folder this user
    can write, or one that can be created: checked before any training, changing nothing."""
    path = Path(out)
    for folder in (path, *path.parents):
        if folder.exists():
            if not folder.is_dir():
                where = "is a file" if folder == path else f"is under {folder}, a file"
                raise AdviceError(
                    f"--out {out!r} {where}, not a folder; pass a folder for the report and "
                    "plots, such as --out advice/"
                )
            if not os.access(folder, os.W_OK | os.X_OK):
                raise AdviceError(
                    f"--out {out!r}: {folder} is not writable by this user; pass a folder "
                    "you can write, such as --out advice/"
                )
            return path
    return path  # a relative path whose parents do not exist yet: the current folder


def plots_available() -> bool:
    """Whether matplotlib (the plots) is installed; said at the start of a run when not."""
    return importlib.util.find_spec("matplotlib") is not None


def _make(spec: str) -> Any:
    factory = load_factory(spec)
    try:
        return factory()
    except Exception as exc:  # the user's code: one line that says where, not a traceback
        raise AdviceError(
            f"{spec}() raised {type(exc).__name__}: {exc}. The factory must be a function of "
            "no arguments returning (model, optimizer factory, batches, loss_fn); call it in "
            "Python to see the traceback"
        ) from exc


def _run(args: argparse.Namespace) -> int:
    out = check_out(args.out)
    states = split_states(args.states)  # a bad --states is refused before any training
    plots = plots_available()
    if not plots:
        warnings.warn(
            "matplotlib is not installed, so this run writes no plots (the report and the "
            "policy file still): pip install 'mixprec[advise]' brings them",
            MixprecWarning,
            stacklevel=1,
        )
    made = _make(args.factory)
    if not isinstance(made, tuple) or len(made) != 4:
        raise AdviceError(
            f"{args.factory} must return (model, optimizer factory, batches, loss_fn), "
            f"got {type(made).__name__}"
        )
    model, optimizer, batches, loss_fn = made
    backend = args.backend or backend_of(model)
    candidates = split_candidates(args.candidates) if args.candidates else None
    options: dict[str, Any] = {
        "candidates": candidates,
        "steps": args.steps,
        "objective": args.objective,
        "states": states,
    }
    api = load_backend(backend)
    if backend == "mxnet":
        name, params = optimizer if isinstance(optimizer, tuple) else (optimizer, None)
        report = api.advise(model, name, params, batches, loss_fn, **options)
    else:
        report = api.advise(model, optimizer, batches, loss_fn, **options)
    print(report.table())
    paths = report.save(out, plots=plots)
    drawn = f"{out}/*.png" if plots else "none (pip install 'mixprec[advise]')"
    print(f"\nreport: {paths['json']}\npolicy: {paths['toml']}\nplots:  {drawn}")
    return 0


EPILOG = """examples:
  mixprec advise my_advice:factory --out advice/ --steps 16
  mixprec advise my_advice:factory --objective memory --candidates O1-bf16,O2-bf16
  mixprec advise mypackage.train:make_model --backend torch
  mixprec advise my_advice:factory --states int8,int4 --objective memory

FACTORY names a function of no arguments in a module importable from the current folder
(my_advice.py above) or the installed packages. It returns (model, make_optimizer, batches,
loss_fn) for PyTorch, (net, (optimizer, optimizer_params), batches, loss_fn) for Gluon.
A complete my_advice.py for each: 'mixprec docs advisor' (section "The command line").

--objective: speed (default) recommends the fastest policy on this machine, float32
included; memory the smallest peak memory; numerics the low-precision policy closest to
float32's loss, to train in wherever low precision is fast.

--states: the low-bit optimizer-state formats to offer (default: int8): float32's twin
(O0,state=int8) and the recommendation's are trained too, each recommended only when
its loss stays within the tolerance of its float32-state twin's; 'none' offers none.
"""


def add_parser(sub: Any) -> None:
    """Add the ``advise`` subcommand to the ``mixprec`` parser's subparsers."""
    advise = sub.add_parser(
        "advise",
        help="train short copies under each policy and advise",
        description="Train short copies of your model under float32 and each candidate "
        "policy, measure speed, memory and loss against float32, find the modules that hurt "
        "in low precision, and recommend a policy. The report, the policy as TOML and four "
        "plots go into --out.",
        epilog=EPILOG,
    )
    advise.add_argument("factory", help="module:function returning (model, opt, batches, loss)")
    advise.add_argument("--backend", choices=("torch", "mxnet"), help="default: from the model")
    advise.add_argument(
        "--candidates",
        help="policies to try (default: all runnable): preset names separated by commas, "
        "key-grammar policies separated by ';' (e.g. 'O1-bf16;base=O2-bf16,compute=bfloat16')",
    )
    advise.add_argument(
        "--steps", type=positive_int, default=20, help="training steps per policy (default: 20)"
    )
    advise.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="speed",
        help="what the recommendation optimises (default: speed, on this machine)",
    )
    advise.add_argument(
        "--states",
        default=",".join(DEFAULT_STATES),
        help="low-bit optimizer-state formats to offer as twins of float32 and of the "
        "recommendation: int8, int4, fp8, comma-separated, or 'none' (default: "
        f"{','.join(DEFAULT_STATES)})",
    )
    advise.add_argument("--out", default="mixprec-advice", help="folder for report and plots")
    advise.set_defaults(run=_run)
