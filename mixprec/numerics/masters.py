"""MasterWeights: which master parameter the optimizer updates for each model parameter.

Framework-neutral bookkeeping: the backend passes callables that read a parameter's dtype
and make a master copy, and this class decides where a copy is needed. There is one master
per *unique* parameter (tied weights share one, as identified by ``key``); a parameter that
is already in the master dtype is its own master (no copy); ``master_dtype=None`` means no
master copies at all, so every parameter is its own master.

The backend's optimizer steps :meth:`masters`; after a step it copies each
:meth:`copied_pairs` master into its model parameter; checkpoints save the masters (exact
float32 values) and loading writes the masters first, then casts them into the model.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Generic, TypeVar

from mixprec.dtypes import canonical_dtype
from mixprec.errors import WrapError

__all__ = ["MasterWeights"]

P = TypeVar("P")


class MasterWeights(Generic[P]):
    """(model parameter, master parameter) pairs, one per unique model parameter.

    :param params: the model parameters the optimizer updates, in order; repeats (tied
        weights) are allowed and share one master.
    :param master_dtype: dtype of the masters (``"float32"``), or None for no masters.
    :param dtype_of: returns a parameter's dtype (any spelling
        :func:`~mixprec.dtypes.canonical_dtype` accepts, such as ``"torch.float16"``).
    :param make_master: returns a new master copy of a parameter in ``master_dtype``.
    :param key: identifies a parameter; two parameters with the same key are one (``id``).
    """

    def __init__(
        self,
        params: Iterable[P],
        *,
        master_dtype: str | None,
        dtype_of: Callable[[P], str],
        make_master: Callable[[P], P],
        key: Callable[[P], Hashable] = id,
    ) -> None:
        if master_dtype is not None:
            master_dtype = canonical_dtype(master_dtype)
        self.master_dtype = master_dtype
        self._key = key
        self.pairs: list[tuple[P, P]] = []
        """One ``(model_param, master)`` per unique parameter, in first-seen order."""
        self._index: dict[Hashable, int] = {}
        copied: list[tuple[P, P]] = []
        for param in params:
            k = key(param)
            if k in self._index:
                continue
            if master_dtype is None or canonical_dtype(dtype_of(param)) == master_dtype:
                pair = (param, param)
            else:
                pair = (param, make_master(param))
                copied.append(pair)
            self._index[k] = len(self.pairs)
            self.pairs.append(pair)
        self._copied = copied

    @property
    def has_copies(self) -> bool:
        """Whether any parameter has a separate master copy."""
        return bool(self._copied)

    def master_for(self, param: P) -> P:
        """The master of ``param`` (``param`` itself when it needs no copy)."""
        index = self._index.get(self._key(param))
        if index is None:
            raise WrapError(
                "this parameter is not managed by mixprec's master weights; it was not among "
                "the optimizer's parameters at wrap time. Add it to the optimizer before "
                "wrapping (or wrap again after add_param_group)"
            )
        return self.pairs[index][1]

    def masters(self) -> list[P]:
        """The parameters the optimizer updates: one master per unique model parameter."""
        return [master for _, master in self.pairs]

    def model_params(self) -> list[P]:
        """The unique model parameters, in the same order as :meth:`masters`."""
        return [param for param, _ in self.pairs]

    def copied_pairs(self) -> list[tuple[P, P]]:
        """Only the pairs whose master is a separate copy (what must be copied back)."""
        return list(self._copied)

    def __deepcopy__(self, memo: dict[int, Any]) -> MasterWeights[P]:
        """A copy whose pairs are the copied parameters and masters (through ``memo``, so a
        model copied in the same call shares them), re-keyed: the index maps keys such as
        ``id(param)``, which a copy changes."""
        new: MasterWeights[P] = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        new._index = {new._key(param): i for i, (param, _) in enumerate(new.pairs)}
        return new

    def __len__(self) -> int:
        return len(self.pairs)

    def __repr__(self) -> str:
        return (
            f"MasterWeights({len(self.pairs)} params, {len(self._copied)} copied, "
            f"master_dtype={self.master_dtype!r})"
        )
