"""mixprec: inspect precision policies, the rules behind each op, and installed backends.

Subcommands:
  ``mixprec policies``               each preset's roles and op lists
  ``mixprec explain POLICY OP``      which rule decides an op's dtype, and why
  ``mixprec backends``               installed backends, versions, capabilities, broken plugins
  ``mixprec advise MODULE:FACTORY``  which policy for your model here (``advisor/command.py``)
  ``mixprec lock POLICY --backend B`` what each op resolves to; ``--check FILE`` names drift
  ``mixprec docs [PAGE]``            the documentation pages shipped with mixprec

Messages follow one format on stderr: ``mixprec: error: ...`` (exit status 2) for a mistake
in the arguments or a refused input, ``mixprec: warning: ...`` for each warning
(:mod:`mixprec.cli_format`).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from pathlib import Path

import mixprec
from mixprec.advisor.command import add_parser as add_advise_parser
from mixprec.backend import Capabilities
from mixprec.cli_format import CliParser, cli_messages, dtype_list
from mixprec.engine.plugins import (
    DISABLE_ENV,
    broken_plugins,
    disabled_plugins,
    list_backends,
    load_backend,
    plugin_preset_sources,
)
from mixprec.engine.spec import get_policy, preset_names
from mixprec.engine.visibility import unseen_notes
from mixprec.errors import MixprecError
from mixprec.lock import add_parser as add_lock_parser
from mixprec.policy.grammar import format_loss_scale
from mixprec.policy.presets import DTYPE_ROLES, builtin_preset_names
from mixprec.policy.value import Policy

__all__ = ["main"]

_LISTS = ("lowp", "fp32", "promote", "banned")


def describe_policy(name: str, policy: Policy, *, lists: bool = True) -> str:
    """A policy as a short block of text: its roles, loss scale, op lists and module rules."""
    lines = [f"{name}"]
    roles = ", ".join(f"{role}={getattr(policy, role) or '-'}" for role in DTYPE_ROLES)
    lines.append(f"  {roles}")
    lines.append(f"  loss_scale={format_loss_scale(policy.loss_scale)}")
    if policy.master_strategy is not None:
        lines.append(f"  master   {policy.describe_master()}")
    if policy.state is not None:
        lines.append(f"  state    {policy.describe_state()}")
    if policy.fp8 is not None:
        lines.append(f"  fp8      linear as FP8 GEMMs, {policy.fp8.describe()}")
    if lists:
        for list_name in _LISTS:
            ops = sorted(getattr(policy.ops, list_name))
            if ops:
                lines.append(f"  {list_name:<8} {', '.join(ops)}")
    for rule in policy.modules:
        target = rule.dtype or ", ".join(f"{op}->{where}" for op, where in rule.ops)
        lines.append(f"  module   {rule.match}:{rule.pattern} -> {target}")
    return "\n".join(lines)


def _cmd_policies(args: argparse.Namespace) -> int:
    names = args.names or preset_names()
    builtin = {name.lower() for name in builtin_preset_names()}
    from_plugins = [name for name in names if name.lower() not in builtin]
    sources = plugin_preset_sources() if from_plugins else {}
    blocks = []
    for name in names:
        block = describe_policy(name, get_policy(name), lists=not args.brief)
        if name in sources:
            first, _, rest = block.partition("\n")
            block = f"{first}  (from the {sources[name]} plugin)\n{rest}"
        blocks.append(block)
    print("\n\n".join(blocks))
    return 0


def _cmd_explain(args: argparse.Namespace) -> int:
    policy = get_policy(args.policy)
    inputs = tuple(args.inputs) if args.inputs else ()
    print(policy.explain(args.op, inputs, module=args.module, module_class=args.module_class))
    if policy.state is not None:  # not an op's business, but part of what the policy keeps
        print(f"Optimizer state: {policy.describe_state()}")
    if args.backend:
        caps = load_backend(args.backend).capabilities()
        entry = caps.unseen(args.op)
        if entry is None:
            print(f"{args.backend}: applies this rule ({args.op} asks the policy)")
        else:
            notes = unseen_notes(policy, caps, [args.op])
            said = notes[0] if notes else f"{args.op}: runs as {entry.native}, as the policy says"
            print(f"{args.backend}: cannot see {args.op!r}. {said}")
    return 0


def _unseen_summary(caps: Capabilities) -> list[str]:
    by_native: dict[str, list[str]] = {}
    for entry in caps.unseen_ops:
        by_native.setdefault(entry.native, []).append(entry.op)
    return [
        f"ops it cannot see ({'no such op' if native == 'absent' else f'run as {native}'}): "
        + ", ".join(sorted(ops))
        for native, ops in sorted(by_native.items())
    ]


def _cmd_backends(args: argparse.Namespace) -> int:
    rows = list_backends()
    if not rows:
        print("no backends installed (pip install 'mixprec[torch]' or 'mixprec[mxnet]')")
    for row in rows:
        version = row.framework_version or "not installed"
        print(f"{row.info.name:<8} {row.info.framework} {version}  (plugin {row.plugin})")
        if row.info.description:
            print(f"         {row.info.description}")
        if row.error:
            print(f"         unavailable: {row.error}")
            continue
        if args.no_capabilities:
            continue
        try:
            caps = load_backend(row.info.name).capabilities()
        except Exception as exc:  # report, and keep listing the other backends
            print(f"         capabilities failed: {type(exc).__name__}: {exc}")
            continue
        for device in caps.devices:
            print(f"         {device.describe()}")
        for line in _unseen_summary(caps):
            print(f"         {line}")
        # a backend's own notes (torch: where its CPU kernels come from), where it has any
        notes = getattr(load_backend(row.info.name), "backend_notes", None)
        for line in notes() if callable(notes) else ():
            print(f"         {line}")
    disabled = disabled_plugins()
    if disabled:
        print(f"\ndisabled by {DISABLE_ENV}: {', '.join(sorted(disabled))}")
    broken = broken_plugins()
    if broken:
        print("\nbroken plugins:")
        for name, error in sorted(broken.items()):
            print(f"  {name}: {error}")
    return 0


#: Where the site is published (``[project.urls]`` Documentation).
DOCS_URL = "https://mixprec.readthedocs.io"


def docs_folder() -> Path | None:
    """The folder of the documentation pages: shipped in the package (``mixprec/_docs``, from
    a wheel), else the ``docs/`` of the checkout mixprec runs from; None when neither."""
    shipped = Path(mixprec.__file__).resolve().parent / "_docs"  # a wheel's package data
    checkout = Path(mixprec.__file__).resolve().parents[1] / "docs"
    for folder in (shipped, checkout):
        if (folder / "index.md").is_file():
            return folder
    return None


def _title(page: Path) -> str:
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return page.stem


def _cmd_docs(args: argparse.Namespace) -> int:
    folder = docs_folder()
    if folder is None:
        raise MixprecError(f"this install carries no documentation pages; read them at {DOCS_URL}")
    pages = {page.stem: page for page in sorted(folder.glob("*.md"))}
    if not args.page:
        print(f"mixprec {mixprec.__version__} documentation, {len(pages)} pages ({folder}):\n")
        for stem, path in pages.items():
            print(f"  {stem:<14} {_title(path)}")
        print(f"\n'mixprec docs PAGE' prints one (Markdown); online: {DOCS_URL}")
        return 0
    name = args.page.lower().removesuffix(".md")
    page = pages.get(name)
    if page is None:
        close = difflib.get_close_matches(name, list(pages), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise MixprecError(
            f"no documentation page {args.page!r}; {hint}the pages: {', '.join(pages)}"
        )
    print(str(page) if args.path else page.read_text(encoding="utf-8"), end="")
    if args.path:
        print()
    return 0


EPILOG = """examples:
  mixprec policies --brief                 every preset get_policy accepts, roles only
  mixprec explain O1-bf16 softmax          which rule decides softmax's dtype under O1-bf16
  mixprec backends                         what each installed backend computes in here
  mixprec advise mymodel:factory           which policy for your model on this machine
  mixprec docs troubleshooting             a documentation page, in the terminal

'mixprec COMMAND --help' describes each command. The documentation ships with mixprec:
'mixprec docs' lists its pages; online at https://mixprec.readthedocs.io
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``mixprec`` command."""
    parser = CliParser(prog="mixprec", description=__doc__.splitlines()[0], epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"mixprec {mixprec.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    policies = sub.add_parser(
        "policies",
        help="print each preset's roles and op lists",
        description="Print each preset's dtype roles, loss scale, op lists and module rules: "
        "the built-in presets, their aliases, then the presets of installed plugins "
        "(torch-autocast* come from the torch plugin).",
        epilog="examples:\n  mixprec policies\n  mixprec policies O2-bf16 torch-autocast\n"
        "  mixprec policies --brief",
    )
    policies.add_argument(
        "names", nargs="*", help="presets to show (default: every name get_policy accepts)"
    )
    policies.add_argument("--brief", action="store_true", help="roles only, no op lists")
    policies.set_defaults(run=_cmd_policies)

    explain = sub.add_parser(
        "explain",
        help="show which rule decides an op's dtype",
        description="Walk the policy's rules for one op, in the order they apply, and show "
        "which one decides the op's dtype.",
        epilog="examples:\n  mixprec explain O1-bf16 softmax --inputs bfloat16\n"
        "  mixprec explain 'O1,path:head=float32' linear --inputs float16 --module head\n"
        "  mixprec explain policy.toml layer_norm --module-class LayerNorm",
    )
    explain.add_argument("policy", help="a preset name, key grammar or .toml file")
    explain.add_argument("op", help="a neutral op name such as softmax or linear")
    explain.add_argument(
        "--inputs",
        type=dtype_list,
        help="comma-separated input dtypes, e.g. float16,float32 (int64, bool... take no part)",
    )
    explain.add_argument("--module", help="the module's qualified name, e.g. encoder.0.attn")
    explain.add_argument("--module-class", help="the module's class name, e.g. BatchNorm2d")
    explain.add_argument(
        "--backend", help="also say whether this backend can apply the rule (e.g. jax)"
    )
    explain.set_defaults(run=_cmd_explain)

    backends = sub.add_parser(
        "backends",
        help="list installed backends and broken plugins",
        description="List the installed backends, their framework versions, the dtypes each "
        "device computes in (and which are fast), and any plugin that failed to load.",
        epilog="examples:\n  mixprec backends\n  mixprec backends --no-capabilities",
    )
    backends.add_argument(
        "--no-capabilities", action="store_true", help="do not import frameworks to probe devices"
    )
    backends.set_defaults(run=_cmd_backends)
    add_advise_parser(sub)
    add_lock_parser(sub)

    docs = sub.add_parser(
        "docs",
        help="list or print the documentation pages shipped with mixprec",
        description="List the documentation pages that ship with mixprec (no clone or "
        f"network needed), or print one as Markdown. Online: {DOCS_URL}",
        epilog="examples:\n  mixprec docs\n  mixprec docs troubleshooting | less\n"
        "  mixprec docs errors --path",
    )
    docs.add_argument("page", nargs="?", help="a page name, e.g. advisor, errors, guide")
    docs.add_argument("--path", action="store_true", help="print the page's file path instead")
    docs.set_defaults(run=_cmd_docs)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mixprec`` console script (and of ``python -m mixprec``).

    Bare ``mixprec`` prints the help. Errors are one line on stderr with exit status 2.
    """
    parser = build_parser()
    with cli_messages() as report:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 0
        return report(lambda: int(args.run(args)))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
