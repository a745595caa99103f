"""What MXNet's own AMP does with each op: the Gluon answer to the lockfile's hook.

MXNet's mixed precision is a graph pass driven by op lists (``mxnet.contrib.amp.lists``:
``symbol_fp16`` for float16, ``symbol_bf16`` for bfloat16). :func:`native_dtypes` reads, for
each neutral family, where those lists put its first native op (:data:`..ops.FAMILY_OPS`):
the low-precision list runs it in the target dtype, the float32 list in float32, the
"either" list and the widest-type list in the dtype of its inputs (all one dtype here), and
a conditional entry (``Activation`` with ``act_type='softrelu'``) in float32 when the
family's attribute values are all listed. An op in no list is left out. The lists are the
same for every device, and nothing is probed: the answer does not depend on this machine's
CPU (its bfloat16 kernels are the Trainer's business, not MXNet's lists').
"""

from __future__ import annotations

from mxnet.contrib.amp.lists import symbol_bf16, symbol_fp16

from mixprec.errors import BackendNotAvailable
from mixprec.kit import BFLOAT16, FLOAT32, NativeDtypes

from ..ops import FAMILY_OPS, NativeOp

__all__ = ["native_dtypes"]


def _lists(compute: str) -> tuple[str, dict[str, set[str]], list[tuple[str, str, list[str]]]]:
    if compute == BFLOAT16:
        module, lowp, either = symbol_bf16, "BF16_FUNCS", "BF16_FP32_FUNCS"
    else:
        module, lowp, either = symbol_fp16, "FP16_FUNCS", "FP16_FP32_FUNCS"
    kinds = {
        "lowp": set(getattr(module, lowp)),
        "fp32": set(module.FP32_FUNCS),
        "input": set(getattr(module, either)) | set(module.WIDEST_TYPE_CASTS),
    }
    name = f"mxnet.contrib.amp.lists.{module.__name__.rsplit('.', 1)[-1]}"
    return name, kinds, list(module.CONDITIONAL_FP32_FUNCS)


def _dtype(
    native: NativeOp,
    kinds: dict[str, set[str]],
    conditional: list[tuple[str, str, list[str]]],
    compute: str,
    inputs: str,
) -> str | None:
    for op, param, values in conditional:
        if op == native.name and param == native.param and set(native.values) <= set(values):
            return FLOAT32
    if native.name in kinds["lowp"]:
        return compute
    if native.name in kinds["fp32"]:
        return FLOAT32
    if native.name in kinds["input"] or any(op == native.name for op, _, _ in conditional):
        return inputs
    return None


def native_dtypes(device: str, compute: str) -> NativeDtypes:
    """Where ``mxnet.contrib.amp``'s lists for ``compute`` put each family's first native
    op, for float32 inputs and for ``compute`` inputs.

    :param device: ``"cpu"`` or ``"cuda"`` (a GPU): the lists are the same for both.
    :raises BackendNotAvailable: another device.
    """
    if device.split(":")[0] not in ("cpu", "cuda"):
        raise BackendNotAvailable(
            f"the mxnet backend locks for 'cpu' or 'cuda', not {device!r}; pass --device cpu "
            "or --device cuda"
        )
    source, kinds, conditional = _lists(compute)
    dtypes: dict[str, dict[str, str | None]] = {}
    for family, natives in FAMILY_OPS.items():
        answers = {
            inputs: _dtype(natives[0], kinds, conditional, compute, inputs)
            for inputs in (FLOAT32, compute)
        }
        if all(answer is not None for answer in answers.values()):
            dtypes[family] = answers
    return NativeDtypes(source=source, dtypes=dtypes)
