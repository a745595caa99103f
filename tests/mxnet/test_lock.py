"""The precision lockfile on Gluon: what MXNet's own AMP lists do with the ops a policy
passes through is recorded, read from those lists (the same on every CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

mx = pytest.importorskip("mxnet")

from mxnet.contrib import amp  # noqa: E402
from mxnet.contrib.amp.amp import bfloat16  # noqa: E402  (MXNet's own dtype object)

import mixprec  # noqa: E402
import mixprec.mxnet as mpx  # noqa: E402
from mixprec_mxnet.ops import FAMILY_OPS  # noqa: E402

pytestmark = pytest.mark.mxnet


@pytest.mark.parametrize("compute", ["bfloat16", "float16"])
def test_native_answers_follow_mxnets_amp_lists(compute: str) -> None:
    native = mpx.native_dtypes("cpu", compute)
    assert native.source.startswith("mxnet.contrib.amp.lists.symbol_")
    target = bfloat16 if compute == "bfloat16" else compute
    lowp, fp32 = set(amp.list_lp16_ops(target)), set(amp.list_fp32_ops(target))
    either = set(amp.list_lp16_fp32_ops(target)) | set(amp.list_widest_type_cast(target))
    for family, answers in native.dtypes.items():
        op = FAMILY_OPS[family][0]
        if op.param is not None:
            continue  # picked out of a shared op by an attribute
        for inputs, produced in answers.items():
            if op.name in lowp:
                assert produced == compute, family
            elif op.name in fp32:
                assert produced == "float32", family
            else:
                assert op.name in either and produced == inputs, family
    assert {"linear", "softmax", "relu", "dropout"} <= set(native.dtypes)


def test_an_o1_bf16_lock_records_the_lists_for_passthrough_ops_and_checks_clean(
    tmp_path: Path,
) -> None:
    lock = mixprec.write_lock("O1-bf16", "mxnet", tmp_path / "gluon.lock")
    assert lock.native == "mxnet.contrib.amp.lists.symbol_bf16" and "mxnet" in lock.versions
    # dropout: O1-bf16 passes it through, MXNet's bfloat16 lists keep Dropout in float32
    assert "Dropout" in amp.list_fp32_ops(bfloat16)
    assert (lock.ops["dropout"].lowp, lock.ops["dropout"].native_lowp) == ("bfloat16", "float32")
    assert lock.ops["relu"].native_lowp == "bfloat16" and lock.ops["linear"].native_lowp is None
    assert mixprec.check_lock(tmp_path / "gluon.lock").ok
