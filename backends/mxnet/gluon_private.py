"""Every private MXNet/Gluon name the backend relies on, in one place, each with its reason.

MXNet 1.9.1 is the last 1.x release and gives no public way to do several things mixprec
must do (install a converted graph in a user's own net, cast a parameter with rounding,
run the AMP graph pass with custom lists, skip an update). Each private name is either
reached through a function here or, where the backend's ``Trainer`` inherits the state
from ``gluon.Trainer``, listed in :data:`TRAINER_STATE`. ``tests/mxnet/test_mx_private.py``
checks every name against the installed MXNet, so an upgrade that renames one fails there,
loudly and by name, instead of deep inside a training step.
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Collection, Sequence
from typing import Any

from mxnet import gluon, nd
from mxnet.base import _LIB, SymbolHandle, c_array_buf, c_str_array, check_call, mx_uint
from mxnet.ndarray import _DTYPE_MX_TO_NP, _DTYPE_NP_TO_MX, NDArray
from mxnet.symbol import Symbol

__all__ = [
    "BLOCK_STATE",
    "EMBEDDING_STATE",
    "GLUON_TRAINER_ARGS",
    "NDARRAY_STATE",
    "OPTIMIZER_STATE",
    "PARAMETER_STATE",
    "SYMBOL_STATE",
    "TRAINER_STATE",
    "cached_graph",
    "children",
    "clear_cached_graph",
    "compose",
    "consume_fresh_grad",
    "deferred_state",
    "dense_embedding_grad",
    "dtype_from_type_code",
    "finish_deferred_init",
    "gluon_trainer_args",
    "has_fresh_grad",
    "has_grad",
    "has_stepped",
    "infer_type_codes",
    "init_from",
    "install_traced_graph",
    "is_active",
    "is_deferred",
    "is_sparse",
    "optimizer_step",
    "own_params",
    "params_with_prefix",
    "reduce_precision_symbol",
    "registered_params",
    "replace_param_data",
    "restore_deferred_state",
    "retrace_graph",
    "set_cached_graph",
    "set_update_counts",
    "type_code",
    "update_counts",
]

#: ``HybridBlock`` internals: ``_children`` and ``_reg_params`` are a block's sub-blocks and
#: own parameters (Gluon 1.x exposes only the recursive ``collect_params``); ``_cached_graph``,
#: ``_get_graph``, ``_clear_cached_op`` and ``_active`` let O1 install the converted graph in
#: the user's own net (``amp.convert_hybrid_block`` returns a copy instead);
#: ``_collect_params_with_prefix`` gives the names ``save_parameters`` writes; ``_in_format``
#: is the structure of the inputs of the last traced call and ``_build_cache`` traces and
#: caches the graph for inputs of that structure (``export`` before the next forward).
BLOCK_STATE = (
    "_children",
    "_reg_params",
    "_cached_graph",
    "_get_graph",
    "_clear_cached_op",
    "_active",
    "_collect_params_with_prefix",
    "_in_format",
    "_build_cache",
)

#: ``Parameter`` internals: ``_grad`` tells whether gradient buffers exist (as
#: ``ParameterDict.zero_grad`` asks); ``_data``/``_dtype``/``_init_grad`` cast a parameter with
#: round-to-nearest (``Parameter.cast`` truncates through ``astype``); ``_deferred_init``,
#: ``_finish_deferred_init`` and ``_init_impl`` finish shapes before the first cast and create
#: masters; ``_stype``/``_grad_stype`` detect sparse parameters, which need the kvstore update;
#: ``_shape``/``_ctx_list``/``_ctx_map`` are put back with them after a failed first forward.
PARAMETER_STATE = (
    "_data",
    "_dtype",
    "_init_grad",
    "_grad",
    "_deferred_init",
    "_finish_deferred_init",
    "_init_impl",
    "_stype",
    "_grad_stype",
    "_shape",
    "_ctx_list",
    "_ctx_map",
)

#: ``NDArray._fresh_grad``: gluon.Trainer's stale-gradient check, which a skipped step must
#: consume as an update would. ``Symbol._compose``: feeds a non-float32 input through an
#: ``identity`` node the AMP pass can attach its casts to.
NDARRAY_STATE = ("_fresh_grad",)
SYMBOL_STATE = ("_compose",)

#: ``gluon.nn.Embedding._kwargs``: the ``sparse_grad`` flag its op is called with; a
#: sparse-gradient Embedding is switched to dense gradients (sparse ones need the kvstore
#: update, which cannot skip an overflowed step).
EMBEDDING_STATE = ("_kwargs",)

#: ``mx.optimizer.Optimizer`` internals a custom optimizer (``"adamw"``) uses, as MXNet's
#: own optimizers do: the per-index update counter and the learning rate / weight decay
#: with their ``lr_mult``/``wd_mult`` applied.
OPTIMIZER_STATE = (
    "_update_count",
    "_index_update_count",
    "_all_index_update_counts",
    "_get_lr",
    "_get_wd",
)

#: ``gluon.Trainer`` state the mixprec ``Trainer`` (a subclass) reads and drives, because its
#: step replaces ``gluon.Trainer.update``: the parameters, optimizer and updaters it updates
#: through, the kvstore it reduces over and initialises eagerly for ``dist_sync``, and the
#: ``_scale`` folded into ``rescale_grad``.
TRAINER_STATE = (
    "_params",
    "_contexts",
    "_optimizer",
    "_updaters",
    "_scale",
    "_kvstore",
    "_kv_initialized",
    "_update_on_kvstore",
    "_compression_params",
    "_params_to_init",
    "_init_kvstore",
    "_init_params",
)


#: ``gluon.Trainer`` state read by :func:`gluon_trainer_args`: the constructor arguments a
#: plain Gluon trainer was built with (``mixprec.compat.mxnet_amp.init_trainer`` rebuilds it
#: as a mixprec ``Trainer`` from them) and whether it has stepped already.
GLUON_TRAINER_ARGS = (
    "_params",
    "_optimizer",
    "_kvstore_params",
    "_compression_params",
    "_kv_initialized",
)


def gluon_trainer_args(trainer: gluon.Trainer) -> tuple[list[gluon.Parameter], Any, dict[str, Any]]:
    """``(params, optimizer, kwargs)`` that rebuild ``trainer``: ``kwargs`` holds
    ``kvstore``, ``compression_params`` and ``update_on_kvstore`` as it was given them.

    Why private: ``gluon.Trainer`` keeps its constructor arguments only in private fields.
    """
    kwargs = {
        "kvstore": trainer._kvstore_params["kvstore"],
        "update_on_kvstore": trainer._kvstore_params["update_on_kvstore"],
        "compression_params": trainer._compression_params,
    }
    return list(trainer._params), trainer._optimizer, kwargs


def has_stepped(trainer: gluon.Trainer) -> bool:
    """Whether ``trainer`` has stepped (its kvstore or optimizer state exists), so that
    rebuilding it would lose state."""
    return bool(trainer._kv_initialized or trainer._optimizer.num_update > 0)


def children(block: gluon.Block) -> dict[str, gluon.Block]:
    """A block's direct sub-blocks by name (``"0"``, ``"body"``), in registration order."""
    return dict(block._children.items())


def own_params(block: gluon.Block) -> list[gluon.Parameter]:
    """The parameters a block registered itself (not its children's)."""
    return list(block._reg_params.values())


def registered_params(block: gluon.Block) -> dict[str, gluon.Parameter]:
    """The parameters a block registered itself, by their attribute names (``"weight"``)."""
    return dict(block._reg_params.items())


def cached_graph(block: gluon.HybridBlock) -> tuple[Any, Symbol]:
    """The ``(inputs, symbol)`` a hybridized block traced on its last first call."""
    return block._cached_graph  # type: ignore[no-any-return]


def clear_cached_graph(block: gluon.Block) -> None:
    """Make a hybridized block trace its graph again at its next call (after a conversion:
    a graph traced before it would run the old dtypes)."""
    if isinstance(block, gluon.HybridBlock) and not isinstance(block, gluon.SymbolBlock):
        block._clear_cached_op()


def set_cached_graph(block: gluon.HybridBlock, graph: tuple[Any, Symbol]) -> None:
    """Make ``block`` run ``graph`` (``(inputs, symbol)``) from its next call on: how an
    imported ``SymbolBlock``'s graph gets its float32 islands."""
    block._cached_graph = graph
    block._clear_cached_op()


def params_with_prefix(block: gluon.Block) -> dict[str, gluon.Parameter]:
    """Parameters by the names ``save_parameters`` writes (``"0.weight"``)."""
    return dict(block._collect_params_with_prefix())


def install_traced_graph(net: gluon.HybridBlock, convert: Any) -> None:
    """Make ``net`` cache ``convert(trace, args)`` in place of each graph it traces.

    ``convert`` gets a function that traces the graph (returning ``(inputs, symbol)``) and
    the call's arguments, and returns the ``(inputs, symbol)`` to cache. Gluon 1.x caches the
    traced graph in ``_cached_graph``, built by ``_get_graph``; replacing that method on the
    instance and clearing the cached op is the only way to change the user's own net's graph.
    """
    trace = type(net)._get_graph

    def _get_graph(*args: Any) -> Any:
        if not net._cached_graph:
            net._cached_graph = convert(lambda: trace(net, *args), args)
        return net._cached_graph

    net._get_graph = _get_graph
    net._clear_cached_op()
    if not net._active:
        net.hybridize()


def retrace_graph(block: gluon.HybridBlock) -> None:
    """Trace and cache ``block``'s graph again, for float32 inputs structured as those of the
    call that traced it last (a conversion cleared the graph; ``export`` needs the graph and
    the parameter list ``_build_cache`` makes, before a forward).

    Why private: a traced graph depends only on the inputs' structure, which Gluon keeps in
    ``_in_format``; ``_build_cache`` traces with placeholders of that structure (the
    parameters are initialised already, so their values are not read).
    """

    def build(fmt: Any) -> Any:
        if isinstance(fmt, int):
            if fmt == 0:
                return nd.zeros((1,))
            return None if fmt == -1 else [nd.zeros((1,)) for _ in range(fmt)]
        return [build(f) for f in fmt]

    block._build_cache(*build(block._in_format))


def compose(sym: Symbol, **inputs: Symbol) -> Symbol:
    """A copy of ``sym`` with the named inputs replaced (``Symbol._compose`` on a copy)."""
    sym = sym.__copy__()
    sym._compose(**inputs)
    return sym


def replace_param_data(param: gluon.Parameter, np_dtype: Any, convert: Any) -> None:
    """Set ``param``'s dtype and replace each context's array by ``convert(array)``; fresh
    gradient buffers follow (``Parameter.cast`` would round by truncation instead)."""
    param._dtype = np_dtype
    if param._data is None:
        return
    param._data = [convert(data) for data in param._data]
    param._init_grad()


def init_from(param: gluon.Parameter, data: NDArray, contexts: Sequence[Any]) -> None:
    """Initialise ``param`` with ``data`` on ``contexts`` (what ``initialize`` does inside)."""
    param._init_impl(data, contexts)


def is_active(block: gluon.HybridBlock) -> bool:
    """Whether ``block`` runs its cached graph (``hybridize()`` on, not ``active=False``)."""
    return bool(block._active)


def is_deferred(param: gluon.Parameter) -> bool:
    """Whether ``param`` still waits for its shape (deferred initialisation)."""
    return bool(param._deferred_init)


#: What a deferred parameter's initialisation changes (shape, data, gradients, contexts).
_DEFERRED_FIELDS = ("_shape", "_deferred_init", "_data", "_grad", "_ctx_list", "_ctx_map")


def deferred_state(
    params: Sequence[gluon.Parameter],
) -> list[tuple[gluon.Parameter, dict[str, Any]]]:
    """What :func:`restore_deferred_state` needs to undo a failed shape inference.

    Why private: a shape inference that fails half-way (the first input does not fit the
    net) leaves some parameters initialised with the wrong shapes; Gluon has no way back to
    "deferred", so the fields it changed are put back.
    """
    return [(p, {name: getattr(p, name, None) for name in _DEFERRED_FIELDS}) for p in params]


def restore_deferred_state(states: Sequence[tuple[gluon.Parameter, dict[str, Any]]]) -> None:
    """Put deferred parameters back as :func:`deferred_state` found them."""
    for param, fields in states:
        for name, value in fields.items():
            setattr(param, name, value)


def finish_deferred_init(param: gluon.Parameter) -> None:
    """Allocate ``param`` once its shape is known (after ``infer_shape``)."""
    param._finish_deferred_init()


def is_sparse(param: gluon.Parameter) -> bool:
    """Whether ``param`` or its gradient uses a sparse storage type."""
    return bool(param._stype != "default" or param._grad_stype != "default")


def has_grad(param: gluon.Parameter) -> bool:
    """Whether ``param`` has gradient buffers (initialised, ``grad_req`` not ``'null'``)."""
    return param._grad is not None


def has_fresh_grad(data: NDArray) -> bool:
    """Whether backward wrote ``data``'s gradient since the last update (Gluon's check)."""
    return bool(data._fresh_grad)


def consume_fresh_grad(data: NDArray) -> None:
    """Mark ``data``'s gradient as used, as ``gluon.Trainer.update`` does (also on a skip)."""
    data._fresh_grad = False


def optimizer_step(optimizer: Any, index: int) -> tuple[float, float, int]:
    """Count one update of ``index`` and return its (learning rate, weight decay, step t)."""
    optimizer._update_count(index)
    t = optimizer._index_update_count[index]
    return float(optimizer._get_lr(index)), float(optimizer._get_wd(index)), int(t)


def update_counts(optimizer: Any) -> dict[int, dict[int, int]]:
    """An optimizer's per-parameter update counts (Adam's step ``t``), ``{device: {index:
    count}}``: the live dicts, which :func:`set_update_counts` fills in place.

    Why private: MXNet keeps them only in ``_all_index_update_counts`` (with
    ``_index_update_count`` an alias of the current device's dict); a resumed Adam needs them.
    """
    return optimizer._all_index_update_counts  # type: ignore[no-any-return]


def set_update_counts(optimizer: Any, counts: dict[int, dict[int, int]]) -> None:
    """Replace an optimizer's update counts by ``counts``, keeping each device's dict (the
    current device's is aliased by ``_index_update_count``)."""
    live = optimizer._all_index_update_counts
    for device in list(live):
        live[device].clear()
    for device, per_index in counts.items():
        live.setdefault(device, {}).update(per_index)


def dense_embedding_grad(block: gluon.nn.Embedding) -> bool:
    """Give a ``sparse_grad=True`` Embedding dense gradients; return whether it had sparse."""
    if not block._kwargs.get("sparse_grad"):
        return False
    block._kwargs["sparse_grad"] = False
    weight = block.weight
    weight._grad_stype = "default"
    if weight._data is not None:
        weight._init_grad()
    return True


def type_code(np_dtype: Any) -> int:
    """MXNet's integer type flag for a numpy dtype (its bfloat16 structured dtype included)."""
    return int(_DTYPE_NP_TO_MX[np_dtype])


def dtype_from_type_code(code: int) -> Any:
    """The numpy dtype for one of MXNet's integer type flags."""
    return _DTYPE_MX_TO_NP[code]


def reduce_precision_symbol(
    sym: Symbol,
    target_code: int,
    lists: tuple[Collection[str], Collection[str], Collection[str]],
    conditional: Sequence[tuple[str, str, Sequence[str]]],
    excluded: Sequence[str],
    params: Sequence[str],
    data_names: Sequence[str],
) -> Symbol:
    """MXNet's ``ReducePrecision`` graph pass through its C API (``MXReducePrecisionSymbol``).

    Why private: ``amp.convert_symbol`` checks every list against MXNet's built-in op sets and
    ``convert_hybrid_block`` returns a copy of the net; mixprec needs its own lists and the
    user's net. ``lists`` is (low precision, float32, widest-type) op names; ``conditional``
    holds ``(op, param, values)`` entries.
    """
    lowp, fp32, widest = (sorted(names) for names in lists)
    indptr, param_names, param_values, cond_ops = [0], [], [], []
    for op, param, values in conditional:
        param_values += list(values)
        indptr.append(len(param_values))
        param_names.append(param)
        cond_ops.append(op)
    target = ctypes.c_int(target_code)
    out = SymbolHandle()
    check_call(
        _LIB.MXReducePrecisionSymbol(
            sym.handle, ctypes.byref(out),
            mx_uint(len(data_names)), c_array_buf(ctypes.c_int, array("i", [0] * len(data_names))),
            mx_uint(len(indptr)), c_array_buf(ctypes.c_int, array("i", indptr)),
            ctypes.byref(target), ctypes.c_int(0),
            mx_uint(len(lowp)), mx_uint(len(fp32)), mx_uint(len(widest)), mx_uint(len(cond_ops)),
            mx_uint(len(excluded)), mx_uint(len(params)),
            c_str_array(lowp), c_str_array(fp32), c_str_array(widest), c_str_array(cond_ops),
            c_str_array(list(excluded)), c_str_array(param_names), c_str_array(param_values),
            c_str_array(list(params)), c_str_array(list(data_names)),
        )
    )  # fmt: skip
    return Symbol(out)


def infer_type_codes(sym: Symbol, input_codes: dict[str, int]) -> list[int]:
    """The type flag of every output of ``sym`` (-1 where unknown), from its inputs' flags.

    Why private: ``Symbol.infer_type`` takes numpy dtypes and cannot express bfloat16; the C
    API ``MXSymbolInferTypePartial`` takes MXNet's integer flags.
    """
    keys = list(input_codes)
    codes = [input_codes[k] for k in keys]
    sizes = [mx_uint() for _ in range(3)]
    data = [ctypes.POINTER(ctypes.c_int)() for _ in range(3)]
    complete = ctypes.c_int()
    check_call(
        _LIB.MXSymbolInferTypePartial(
            sym.handle, mx_uint(len(keys)), c_str_array(keys),
            c_array_buf(ctypes.c_int, array("i", codes)),
            ctypes.byref(sizes[0]), ctypes.byref(data[0]), ctypes.byref(sizes[1]),
            ctypes.byref(data[1]), ctypes.byref(sizes[2]), ctypes.byref(data[2]),
            ctypes.byref(complete),
        )
    )  # fmt: skip
    return [data[1][i] for i in range(sizes[1].value)]
