"""MasterWeights: one master per unique parameter, copies only where needed."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import count

import pytest

from mixprec.errors import WrapError
from mixprec.numerics.masters import MasterWeights

_ids = count()


@dataclass(eq=False)
class Param:
    """A stand-in for a framework parameter: a dtype and an identity."""

    dtype: str
    name: str = field(default_factory=lambda: f"p{next(_ids)}")


def masters_of(params, master_dtype="float32"):
    made: list[Param] = []

    def make_master(p: Param) -> Param:
        master = Param("float32", p.name + ".master")
        made.append(master)
        return master

    mw = MasterWeights(
        params, master_dtype=master_dtype, dtype_of=lambda p: p.dtype, make_master=make_master
    )
    return mw, made


def test_tied_weights_share_one_master():
    embedding, hidden = Param("float16"), Param("float16")
    mw, made = masters_of([embedding, hidden, embedding])  # output layer tied to embedding
    assert len(mw) == 2 and len(made) == 2
    assert mw.model_params() == [embedding, hidden]
    assert mw.master_for(embedding) is made[0]
    assert mw.master_for(hidden) is made[1]


def test_float32_params_are_their_own_master():
    norm, weight = Param("float32"), Param("bfloat16")
    mw, made = masters_of([norm, weight])
    assert mw.master_for(norm) is norm
    assert len(made) == 1
    assert mw.masters() == [norm, made[0]]
    assert mw.copied_pairs() == [(weight, made[0])]
    assert mw.has_copies


def test_dtype_spellings_are_canonicalised():
    mw, made = masters_of([Param("torch.float32"), Param("fp32")], master_dtype="float")
    assert made == [] and not mw.has_copies


def test_no_master_dtype_means_no_masters():
    params = [Param("float16"), Param("float16")]
    mw, made = masters_of(params, master_dtype=None)
    assert made == [] and mw.copied_pairs() == []
    assert mw.masters() == params
    assert all(mw.master_for(p) is p for p in params)


def test_unknown_param_names_the_fix():
    mw, _ = masters_of([Param("float16")])
    with pytest.raises(WrapError, match="not among the optimizer's parameters"):
        mw.master_for(Param("float16"))


def test_custom_key():
    a, b = Param("float16", "shared"), Param("float16", "shared")
    mw = MasterWeights(
        [a, b],
        master_dtype="float32",
        dtype_of=lambda p: p.dtype,
        make_master=lambda p: Param("float32"),
        key=lambda p: p.name,
    )
    assert len(mw) == 1 and mw.master_for(b) is mw.master_for(a)


def test_a_deep_copy_pairs_the_copied_params_with_the_copied_masters():
    """A model deep-copied together with its master map (one memo) finds its own masters;
    the original's lookups are unchanged."""
    import copy

    tied, norm = Param("bfloat16"), Param("float32")
    mw, made = masters_of([tied, norm, tied])
    params_copy, mw_copy = copy.deepcopy(([tied, norm], mw))
    tied_copy, norm_copy = params_copy
    assert mw_copy.master_for(tied_copy) is mw_copy.masters()[0]
    assert mw_copy.master_for(tied_copy) is not made[0]
    assert mw_copy.master_for(tied_copy).name == made[0].name
    assert mw_copy.master_for(norm_copy) is norm_copy
    assert mw_copy.copied_pairs() == [(tied_copy, mw_copy.masters()[0])]
    assert mw.master_for(tied) is made[0]
    with pytest.raises(WrapError):
        mw_copy.master_for(tied)
