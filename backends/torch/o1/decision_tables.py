"""O1's answers, decided at wrap time and looked up while a forward runs.

O1's kernels (:mod:`mixprec_torch.o1.autocast_kernels`) need, for every operator they run, the dtype
``Policy.decide`` gives the op for the call's floating inputs in the current module context.
``decide`` matches rules (globs, class names), which is too slow to run per call. So the
answers are prepared once:
:class:`Decisions` holds them keyed by (op, decision context, input key), filled at wrap time
for every intercepted op, every decision context of the model's modules, and every
combination of the float16, bfloat16, float32 and float64 inputs an op can receive
(contexts that match the same module rules share one table).

The *input key* of a call is (the first floating input's dtype, the set of all its floating
dtypes as bits): all ``decide`` reads of the inputs (a passthrough op keeps the first, a
promote op takes the widest). :func:`input_key` builds it from dict reads alone, so dynamo
folds it to a constant while it traces. Inputs in a dtype outside those four (float8) are
decided on first use and remembered.

A plan without autocast (O2/O3 under float16, whose default lists ban ``binary_cross_entropy``)
only asks whether an op is refused, and that does not depend on which floating dtypes come in
(a ban, an ambiguous rule: ``decide``'s error names no input): :class:`Decisions` made with
``bans_only`` asks once per op and context for floating inputs (:data:`BAN_KEYS`), not 33 times.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.errors import PolicyError
from mixprec.kit import Policy

from ..dtypes import FLOATING, dtype_name, torch_dtype

__all__ = [
    "BAN_KEYS",
    "DTYPE_BITS",
    "PREPARED_KEYS",
    "DecisionContext",
    "Decisions",
    "InputKey",
    "input_key",
]


@dataclass(frozen=True)
class DecisionContext:
    """The module ``Policy.decide`` is asked about: qualified name and class names (MRO)."""

    path: str | None
    classes: tuple[str, ...] | None


InputKey = tuple["torch.dtype | None", int]
"""An op's floating inputs as (the first one's dtype or None, the bit set of all dtypes)."""

_BITS: dict[torch.dtype, int] = {d: 1 << i for i, d in enumerate(sorted(FLOATING, key=str))}
DTYPE_BITS = _BITS
"""Each floating dtype's bit in an :data:`InputKey` (a dtype outside it is not floating)."""
_BY_BIT: dict[int, torch.dtype] = {bit: d for d, bit in _BITS.items()}
_PREPARED: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def input_key(args: Sequence[Any], kwargs: dict[str, Any]) -> InputKey:
    """The (first dtype, dtype bits) of the floating tensors among ``args`` and ``kwargs``
    (one level into lists and tuples; an ``out=`` tensor does not count)."""
    first: torch.dtype | None = None
    mask = 0
    for value in (*args, *(v for k, v in kwargs.items() if k != "out")):
        items = value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if isinstance(item, torch.Tensor):
                bit = _BITS.get(item.dtype, 0)
                if bit:
                    if first is None:
                        first = item.dtype
                    mask |= bit
    return first, mask


def key_names(key: InputKey) -> tuple[str, ...]:
    """The dtype names ``Policy.decide`` is asked with for ``key``, the first one first."""
    first, mask = key
    if first is None:
        return ()
    rest = [d for bit, d in sorted(_BY_BIT.items()) if mask & bit and d != first]
    return tuple(dtype_name(d) for d in (first, *rest))


def _prepared_keys() -> tuple[InputKey, ...]:
    """Every input key over the prepared dtypes: no floating input, or a first dtype and
    any set of the other three beside it (33 keys)."""
    keys: list[InputKey] = [(None, 0)]
    for first in _PREPARED:
        others = [d for d in _PREPARED if d != first]
        for n in range(1 << len(others)):
            mask = _BITS[first]
            for i, other in enumerate(others):
                if n >> i & 1:
                    mask |= _BITS[other]
            keys.append((first, mask))
    return tuple(keys)


PREPARED_KEYS: tuple[InputKey, ...] = _prepared_keys()

_FLOATING_KEY: InputKey = (torch.float32, _BITS[torch.float32])
BAN_KEYS: tuple[InputKey, ...] = ((None, 0), _FLOATING_KEY)
"""The keys a bans-only table prepares: no floating input, and one that stands for every
key with floating inputs (whether ``decide`` raises is the same for all of them)."""

Answer = torch.dtype | PolicyError


class Decisions:
    """``Policy.decide``'s answers for some ops, prepared per decision context.

    A context's answers depend only on which module rules match it, so contexts matching the
    same rules (every BatchNorm of a network under a ``"*BatchNorm*"`` rule) share one table:
    preparing a model costs one set of ``decide`` calls per distinct set of matching rules,
    and one rule match per module.

    :param policy: the resolved policy.
    :param ops: the ops (families and ``"torch:"`` names) to prepare.
    :param bans_only: the answers are only asked whether they raise (kernels at the Autograd
        key of a plan without autocast): prepare :data:`BAN_KEYS` only, and answer every key
        with floating inputs from the one that stands for them.
    """

    def __init__(self, policy: Policy, ops: Iterable[str], *, bans_only: bool = False) -> None:
        self.policy = policy
        self.ops = tuple(sorted(ops))
        self.bans_only = bans_only
        self.keys = BAN_KEYS if bans_only else PREPARED_KEYS
        """The input keys prepared for every op and context."""
        self.tables: dict[DecisionContext | None, dict[tuple[str, InputKey], Answer]] = {}
        """context -> (op, input key) -> its dtype, or the error ``decide`` raised (banned
        ops, ambiguous rules: raised again at each call)."""
        self._shared: dict[tuple[int, ...], dict[tuple[str, InputKey], Answer]] = {}

    def prepare(self, context: DecisionContext | None) -> dict[tuple[str, InputKey], Answer]:
        """The answer table of ``context``: every op for every prepared input key."""
        table = self.tables.get(context)
        if table is not None:
            return table
        rules = self.policy.modules
        matching = (
            ()
            if context is None
            else tuple(i for i, r in enumerate(rules) if r.matches(context.path, context.classes))
        )
        table = self._shared.get(matching)
        if table is None:
            table = self._shared[matching] = {}
            for op in self.ops:
                for key in self.keys:
                    table[(op, key)] = self._decide(op, context, key)
        self.tables[context] = table
        return table

    def _decide(self, op: str, context: DecisionContext | None, key: InputKey) -> Answer:
        inputs = key_names(key)
        try:
            if context is None:
                decision = self.policy.decide(op, inputs)
            else:
                decision = self.policy.decide(op, inputs, context.path, context.classes)
        except PolicyError as err:
            return err
        return torch_dtype(decision.dtype)

    def answer(self, op: str, context: DecisionContext | None, key: InputKey) -> Answer:
        """The dtype ``op`` runs in, or the error ``decide`` raised: lookups (``decide``
        only for an unprepared key, remembered). With ``bans_only`` a key with floating inputs
        is answered by the one standing for them: the error is the call's, a dtype is not."""
        table = self.tables.get(context)
        if table is None:
            table = self.prepare(context)
        answer = table.get((op, key))
        if answer is None and self.bans_only and key[1]:
            answer = table.get((op, _FLOATING_KEY))
        if answer is None:
            answer = table[(op, key)] = self._decide(op, context, key)
        return answer

    def dtype(self, op: str, context: DecisionContext | None, key: InputKey) -> torch.dtype:
        """The dtype ``op`` runs in (:meth:`answer`).

        :raises PolicyError: what ``Policy.decide`` raised for this call.
        """
        answer = self.answer(op, context, key)
        if isinstance(answer, PolicyError):
            raise PolicyError(*answer.args)
        return answer
