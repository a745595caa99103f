"""A griffe extension for the API reference: one docstring style, the names users import.

mixprec's docstrings are Sphinx style. griffe's Sphinx parser reads the field lists
(``:param x:``, ``:returns:``, ``:raises E:``) but leaves the rest of the text to Markdown,
where Sphinx's cross-reference roles (``:class:`~mixprec.Policy```) and literal blocks
(``The loop::``) would print literally. This extension rewrites them once, centrally, so
the docstrings stay as they are:

- a role becomes a link (an autorefs ``<autoref optional>``) to the object it names,
  resolved as Sphinx would: absolute, relative to the module (``.stepping``), or a name in
  the enclosing class or module; ``~`` keeps only the last component as the text;
- a ``::`` literal block becomes a fenced code block (Python when it parses as Python);
- ``:param a, b, c: text`` (one description for several parameters) becomes one field per
  parameter, which griffe's parser expects.

It also mounts each built-in backend's api module under the name users import:
``mixprec.torch`` is ``mixprec_torch`` (a facade at run time, see ``mixprec.engine.facades``), so
``::: mixprec.torch.wrap`` documents ``wrap`` under the heading ``mixprec.torch.wrap``.
"""

from __future__ import annotations

import ast
import html
import importlib.metadata
import re
import textwrap
from typing import Any

import griffe

__all__ = ["MixprecDocs", "builtin_backends", "rewrite_docstring"]

ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|exc|obj|const|any):`(?P<body>[^`]+)`")
MULTI_PARAM = re.compile(r"^(?P<indent>\s*):param (?P<names>\w+(?:, \w+)+):(?P<rest>.*)$")
BARE_LITERAL = re.compile(r"^\s*::\s*$")


def builtin_backends() -> dict[str, str]:
    """``{"torch": "mixprec_torch", ...}``: the backends mixprec's own distribution declares.

    Read from the entry points of the ``mixprec`` distribution (third-party plugins are
    documented by their own projects); each plugin module names its api module without
    importing its framework.
    """
    found: dict[str, str] = {}
    for entry in importlib.metadata.entry_points(group="mixprec"):
        if entry.dist is None or entry.dist.name != "mixprec":
            continue
        plugin = entry.load()
        for info in plugin.mixprec_register_backends():
            found[info.name] = info.api_module
    return found


def _find(collection: Any, path: str) -> Any:
    try:
        return collection.get_member(path) if hasattr(collection, "get_member") else None
    except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


def _resolve(target: str, obj: griffe.Object, collection: Any) -> str | None:
    """The canonical path of the object ``target`` names in ``obj``'s docstring, if any."""
    target = target.strip().rstrip("()")
    module = obj.module
    candidates: list[str] = []
    if target.startswith("."):
        package = module if module.is_package else module.parent
        level = len(target) - len(target.lstrip("."))
        for _ in range(level - 1):
            package = package.parent if package is not None and package.parent else package
        if package is not None:
            candidates.append(f"{package.path}.{target.lstrip('.')}")
    else:
        scope: griffe.Object | None = obj
        while scope is not None:  # the enclosing class, then the module and its packages
            if scope.is_class or scope.is_module:
                candidates.append(f"{scope.path}.{target}")
            scope = scope.parent
        candidates.append(target)
    for path in candidates:
        found = _find(collection, path)
        if found is not None:
            try:
                return str(found.canonical_path)
            except (griffe.AliasResolutionError, griffe.CyclicAliasError):
                return path
    return None


def _role(match: re.Match[str], obj: griffe.Object, collection: Any) -> str:
    body = match["body"]
    explicit = re.fullmatch(r"(?P<title>.+?)\s*<(?P<target>[^>]+)>", body)
    if explicit:
        title, target = explicit["title"], explicit["target"]
    else:
        target = body.lstrip("~")
        title = target.rsplit(".", 1)[-1] if body.startswith("~") else target.lstrip(".")
    code = f"<code>{html.escape(title)}</code>"
    identifier = _resolve(target.lstrip("~"), obj, collection)
    if identifier is None:
        return f"`{title}`"
    return f'<autoref identifier="{html.escape(identifier)}" optional>{code}</autoref>'


def _language(block: str) -> str:
    try:
        ast.parse(block)
    except SyntaxError:
        return "text"
    return "python"


def _literal_blocks(text: str) -> str:
    """reST ``text::`` + an indented block -> ``text:`` + a fenced block."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        opens = line.rstrip().endswith("::") and not line.strip().startswith(":")
        if not (opens or BARE_LITERAL.match(line)):
            out.append(line)
            i += 1
            continue
        indent = len(line) - len(line.lstrip())
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        block: list[str] = []
        while j < len(lines) and (
            not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent
        ):
            block.append(lines[j])
            j += 1
        while block and not block[-1].strip():
            block.pop()
        if not block:
            out.append(line)
            i += 1
            continue
        if not BARE_LITERAL.match(line):
            stripped = line.rstrip()[:-2].rstrip()
            out.append(stripped + ("" if stripped.endswith(":") else ":"))
        code = textwrap.dedent("\n".join(block))
        pad = " " * indent
        out += ["", f"{pad}```{_language(code)}"]
        out += [f"{pad}{row}" if row else "" for row in code.split("\n")]
        out += [f"{pad}```", ""]
        i = j
    return "\n".join(out)


def _split_params(text: str) -> str:
    out = []
    for line in text.split("\n"):
        match = MULTI_PARAM.match(line)
        if match is None:
            out.append(line)
            continue
        for name in match["names"].split(", "):
            out.append(f"{match['indent']}:param {name}:{match['rest']}")
    return "\n".join(out)


def rewrite_docstring(text: str, obj: griffe.Object, collection: Any) -> str:
    """``text`` with Sphinx roles, literal blocks and multi-name params made renderable."""
    text = _split_params(_literal_blocks(text))
    return ROLE.sub(lambda m: _role(m, obj, collection), text)


def _walk(obj: griffe.Object) -> Any:
    yield obj
    for member in obj.members.values():
        if member.is_alias:
            continue
        yield from _walk(member)  # type: ignore[arg-type]


class MixprecDocs(griffe.Extension):
    """Rewrites Sphinx-isms in every loaded docstring; mounts ``mixprec.<backend>``."""

    def __init__(self) -> None:
        super().__init__()
        self._rewritten: set[str] = set()
        self._busy = False

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        """After a package is loaded: load mixprec and its backends, mount ``mixprec.<backend>``
        and rewrite every docstring not rewritten yet (roles resolve across the packages)."""
        if self._busy:
            return
        self._busy = True
        try:
            backends = builtin_backends()
            for path in ("mixprec", *backends.values()):
                if path not in loader.modules_collection:
                    loader.load(path)
            mixprec = loader.modules_collection["mixprec"]
            for name, api_module in backends.items():
                if name not in mixprec.members:
                    mixprec.set_member(name, griffe.Alias(name, api_module, parent=mixprec))
            for path in list(loader.modules_collection.members):
                if path in self._rewritten:
                    continue
                self._rewritten.add(path)
                for obj in _walk(loader.modules_collection[path]):
                    if obj.docstring is not None:
                        obj.docstring.value = rewrite_docstring(
                            obj.docstring.value, obj, loader.modules_collection
                        )
        finally:
            self._busy = False
