"""The mutation tester's choice of mutants (benchmarks/mutation.py)."""

from __future__ import annotations

from benchmarks.mutation import mutants


def _made(source: str) -> list[str]:
    return [m.what for m in mutants(source)]


def test_no_none_to_zero_mutant_inside_an_is_comparison() -> None:
    """``x is 0`` is a SyntaxWarning, an error under the suite's filters: such a mutant never
    imports and was counted killed whatever the tests did (13 of issue 37's rows)."""
    assert _made("ok = x is None\n") == ["Is -> IsNot"]
    assert _made("ok = None is not x\n") == ["IsNot -> Is"]
    assert _made("x = None\n") == ["None -> 0"]  # elsewhere it stays a mutant
    assert _made("ok = x == None\n") == ["Eq -> NotEq", "None -> 0"]
