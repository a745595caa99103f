"""Import floors of a package's modules: the structure tests of both backends use them."""

from __future__ import annotations

from collections.abc import Mapping, Set


def floors_of(graph: Mapping[str, Set[str]], package: str) -> dict[str, int]:
    """Each module's floor in ``graph`` (module -> the sibling modules it imports): 1 + the
    highest floor among its imports, 1 for none.

    :raises AssertionError: naming the circle, when the imports are not a DAG.
    """
    floor: dict[str, int] = {}

    def visit(name: str, path: tuple[str, ...]) -> int:
        if name in path:
            circle = " -> ".join((*path[path.index(name) :], name))
            raise AssertionError(f"import circle in {package}: {circle}")
        if name not in floor:
            floor[name] = 1 + max((visit(d, (*path, name)) for d in graph[name]), default=0)
        return floor[name]

    for name in graph:
        visit(name, ())
    return floor
