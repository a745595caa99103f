"""``net.export`` for deployment: a float32 model by default, bfloat16 with its casts as an option.

Gluon's ``HybridBlock.export`` writes the traced symbol and the parameters as they are. Under
O2/O3 that is a bfloat16 parameter file and a symbol that expects bfloat16 input (mixprec casts
the net's inputs outside the traced graph), so ``SymbolBlock.imports`` fails on float32 input.
The Trainer patches ``net.export`` with :func:`export`:

- ``dtype="float32"`` (default): the symbol without any ``amp_cast`` (MXNet's
  ``remove_amp_cast``, plus the outputs' own casts) and every parameter as its float32
  master value: a plain float32 model that any MXNet runtime loads (and a mixprec Trainer
  takes again), whose output matches the trained net's to bfloat16 rounding.
- ``dtype="bfloat16"``: the trained graph as it runs, casts included, with the input cast to
  the policy's ``param`` dtype and the outputs cast to float32 inside the graph, and the
  parameters in their model dtypes: float32 in, float32 out, the trained net's exact compute.

Each of the two files is written atomically (:mod:`mixprec.atomic`): an export that fails
half-way (a full disk) leaves the previous files whole.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import mxnet as mx
from mxnet import gluon, nd

from mixprec.errors import CheckpointError
from mixprec.kit import FLOAT32, atomic_path, atomic_write_text, is_low_precision

from ..bf16_rounding import cast_source
from ..dtypes import mx_dtype
from ..gluon_private import cached_graph, compose
from ..step.checkpoint import save_arrays
from ..step.trainer_state import float32_value, trainer_state

__all__ = ["export", "patch_export"]


def patch_export(net: gluon.Block, trainer: gluon.Trainer) -> None:
    """Make ``net.export`` go through :func:`export` (this net only; HybridBlocks only)."""
    if isinstance(net, gluon.HybridBlock):
        net.export = functools.partial(export, trainer)


def export(
    trainer: gluon.Trainer,
    path: str,
    epoch: int = 0,
    remove_amp_cast: bool = True,
    dtype: str = FLOAT32,
) -> None:
    """Write ``path-symbol.json`` and ``path-%04d.params`` (``HybridBlock.export``'s files)
    for float32 input; ``dtype="bfloat16"`` keeps the low-precision compute inside the graph
    (``remove_amp_cast`` is then ignored: the casts are the point)."""
    st = trainer_state(trainer)
    net = st.net
    graph = cached_graph(net) if net is not None else ()
    if not graph:
        raise CheckpointError(
            "export needs the traced graph: call net.hybridize() and run one forward pass "
            "before net.export(...)"
        )
    if dtype not in (FLOAT32, st.policy.param):
        raise CheckpointError(
            f"export(dtype={dtype!r}): this net can be exported in float32 or in its policy's "
            f"parameter dtype {st.policy.param!r}"
        )
    inputs, sym = graph
    lowp = dtype != FLOAT32 and is_low_precision(dtype)
    if lowp:
        sym = _cast_boundary(sym, [s.name for s in inputs], dtype)
    elif remove_amp_cast:
        sym = _without_casts(sym)
    else:  # the casts kept: the outputs (the islands' cast back) still leave in float32
        sym = _cast_outputs(sym, FLOAT32)
    # written by Python, not Symbol.save: MXNet's writer leaves a short file on a full disk
    text = sym.tojson(remove_amp_cast=remove_amp_cast and not lowp)
    atomic_write_text(f"{path}-symbol.json", text)
    args, aux = set(sym.list_arguments()), set(sym.list_auxiliary_states())
    arrays: dict[str, nd.NDArray] = {}
    for param in net.collect_params().values():  # type: ignore[union-attr]
        value = param.list_data()[0].copyto(mx.cpu()) if lowp else float32_value(st, param)
        if param.name in args:
            arrays[f"arg:{param.name}"] = value
        elif param.name in aux:
            arrays[f"aux:{param.name}"] = value
    target = f"{path}-{epoch:04d}.params"
    with atomic_path(target) as tmp:
        save_arrays(tmp, arrays, target)


def _cast_boundary(sym: Any, data_names: list[str], dtype: str) -> Any:
    """``sym`` reading float32 ``data_names`` cast to ``dtype``, its outputs cast to float32."""
    target = mx_dtype(dtype)
    casts = {n: mx.sym.amp_cast(mx.sym.var(n), dtype=target, name=f"{n}_cast") for n in data_names}
    return _cast_outputs(compose(sym, **casts), FLOAT32)


def _without_casts(sym: Any) -> Any:
    """``sym`` with no ``amp_cast``/``amp_multicast`` and none of mixprec's own casts left
    (:data:`~..bf16_rounding.OUT_SUFFIX`): MXNet's ``remove_amp_cast`` drops the casts that
    feed other nodes, this drops the outputs' own casts and mixprec's as well (a float32 graph
    needs none, and mixprec refuses to train a graph holding casts)."""
    graph = json.loads(sym.tojson(remove_amp_cast=True))
    nodes = graph["nodes"]
    by_name = {node["name"]: node for node in nodes}

    def uncast(entry: list[int]) -> list[int]:
        while True:
            node = nodes[entry[0]]
            if node["op"] in ("amp_cast", "amp_multicast"):
                entry = node["inputs"][entry[1] if node["op"] == "amp_multicast" else 0]
                continue
            source = cast_source(by_name, node["name"])
            if source is None:
                return entry
            entry = source

    for node in nodes:
        node["inputs"] = [uncast(e) for e in node["inputs"]]
    graph["heads"] = [uncast(head) for head in graph["heads"]]
    return mx.sym.load_json(json.dumps(graph))


def _cast_outputs(sym: Any, dtype: str) -> Any:
    outs = [mx.sym.amp_cast(sym[i], dtype=mx_dtype(dtype)) for i in range(len(sym.list_outputs()))]
    return mx.sym.Group(outs) if len(outs) > 1 else outs[0]
