"""``mxnet.contrib.amp``'s training API on mixprec (``mixprec.compat.mxnet_amp`` is its face).

MXNet's documented AMP loop runs with one import changed::

    from mixprec.compat import mxnet_amp as amp      # was: from mxnet.contrib import amp

    amp.init(target_dtype="bfloat16")
    net = ...; net.initialize(ctx=ctx); net.hybridize()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    amp.init_trainer(trainer)                 # now a mixprec Trainer, same object
    for x, y in data:
        with autograd.record():
            loss = loss_fn(net(x), y)
            with amp.scale_loss(loss, trainer) as scaled:
                autograd.backward(scaled)
        trainer.step(x.shape[0])

What it translates to: :func:`init` picks a policy (``O1`` for float16, ``O1-bf16`` for
bfloat16, with the op lists moved as asked) and patches nothing. :func:`init_trainer`
rebuilds the user's ``gluon.Trainer`` *in place* as a :class:`mixprec_mxnet.Trainer` (same
object, its class changed, same optimizer instance and kvstore settings) on the net that owns
its parameters, found among the live Gluon blocks, or passed as ``net=``. From then on the
trainer is mixprec's: exact loss scaling with no one-step lag, float32 masters under O2,
float32 ``save_parameters``, ``save_states`` with scaler and policy. The graph conversions
run MXNet's graph pass with the same policy lists (:func:`convert_hybrid_block` converts
the user's block in place); ``init`` and the op lists are in :mod:`.contrib_amp_lists`.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import mxnet as mx
from mxnet import gluon
from mxnet.ndarray import NDArray
from mxnet.symbol import Symbol

from mixprec.errors import StepOrderError, WrapError

from ..bf16_kernels import warn_islands
from ..devices import device_key, resolve_policy
from ..gluon_private import cached_graph, children, gluon_trainer_args, has_stepped, retrace_graph
from ..o1.graph import install_graph_pass, reduce_precision
from ..ops import amp_lists
from ..trainer import Trainer
from .contrib_amp_lists import Conditional, current_policy, policy_for

__all__ = [
    "convert_bucketing_module",
    "convert_hybrid_block",
    "convert_model",
    "convert_symbol",
    "find_net",
    "init_trainer",
    "scale_loss",
    "unscale",
]


def init_trainer(optimizer_or_trainer: Any, net: gluon.Block | None = None) -> Trainer:
    """Turn a ``gluon.Trainer`` into a mixprec :class:`~mixprec_mxnet.Trainer`, in place.

    The trainer keeps its identity, optimizer instance, kvstore and compression settings; the
    net that owns exactly its parameters is converted per :func:`init`'s policy. Call it right
    after creating the trainer, as MXNet's docs do. A trainer that already is a mixprec
    ``Trainer`` is returned as it is.

    :param net: the net to convert; by default the one Gluon block (not a child of another
        such block) whose parameters are exactly the trainer's.
    :returns: the same trainer object.
    :raises StepOrderError: :func:`init` was not called, or the trainer has stepped already.
    :raises WrapError: not a Gluon trainer, ``update_on_kvstore=True``, or no single net owns
        exactly the trainer's parameters. Nothing is changed then.
    """
    trainer = optimizer_or_trainer
    if isinstance(trainer, Trainer):
        return trainer
    policy = current_policy()
    if policy is None:
        raise StepOrderError(
            "amp.init_trainer() needs a policy: call amp.init(target_dtype=...) first"
        )
    if not isinstance(trainer, gluon.Trainer):
        raise WrapError(
            f"amp.init_trainer() takes a gluon.Trainer, not {type(trainer).__name__}; build "
            "gluon.Trainer(net.collect_params(), optimizer, ...) and pass that (as with "
            "mxnet.contrib.amp, a bare Optimizer cannot be initialised)"
        )
    if has_stepped(trainer):
        raise StepOrderError(
            "amp.init_trainer(trainer) came after the trainer's first step, whose optimizer "
            "state mixprec cannot take over; call it right after creating the trainer"
        )
    params, optimizer, kwargs = gluon_trainer_args(trainer)
    if not params:
        raise WrapError("the trainer has no parameters to train; build it on net.collect_params()")
    if kwargs.pop("update_on_kvstore"):
        raise WrapError(
            "the trainer was built with update_on_kvstore=True, where an overflowed step "
            "cannot be skipped; build it with update_on_kvstore=False (as MXNet's AMP docs do)"
        )
    net = _checked_net(net, params) if net is not None else find_net(params)
    resolve_policy(policy, params[0].list_ctx())  # refuse bad dtypes before changing
    # Re-run construction on the user's own object, so every reference to it (the loop's
    # `trainer`) now steps through mixprec; a failure puts the plain trainer back.
    before = (trainer.__class__, dict(trainer.__dict__))
    trainer.__class__ = Trainer
    converted: Trainer = trainer
    try:
        Trainer.__init__(converted, net, optimizer, None, policy=policy, **kwargs)
    except BaseException:
        trainer.__class__ = before[0]
        trainer.__dict__.clear()
        trainer.__dict__.update(before[1])
        raise
    return converted


def _param_ids(block: gluon.Block) -> set[int]:
    return {id(p) for p in block.collect_params().values()}


def _checked_net(net: gluon.Block, params: list[gluon.Parameter]) -> gluon.Block:
    if not isinstance(net, gluon.Block):
        raise WrapError(f"net= must be a Gluon Block, not {type(net).__name__}")
    if _param_ids(net) != {id(p) for p in params}:
        raise WrapError(
            f"the trainer's parameters are not exactly those of {type(net).__name__} "
            f"({len(params)} against {len(_param_ids(net))}); mixprec converts and trains "
            "whole nets: build the trainer on net.collect_params() and freeze parameters "
            "with grad_req='null'"
        )
    return net


def find_net(params: list[gluon.Parameter]) -> gluon.Block:
    """The one live Gluon block whose parameters are exactly ``params`` and that is not a
    child of another such block (``gluon.Trainer`` keeps parameters, not the net).

    :raises WrapError: no block or several unrelated blocks own exactly ``params``.
    """
    wanted = {id(p) for p in params}
    gc.collect()  # a dropped net still in a reference cycle must not count as an owner
    # type(), not isinstance(): isinstance reads `__class__`, which some live objects
    # (deprecated torch aliases) answer with a warning
    owners = [
        obj
        for obj in gc.get_objects()
        if issubclass(type(obj), gluon.Block) and _param_ids(obj) == wanted
    ]
    inner = {id(child) for owner in owners for child in _descendants(owner)}
    roots = [owner for owner in owners if id(owner) not in inner]
    if len(roots) == 1:
        return roots[0]
    found = ", ".join(sorted(type(r).__name__ for r in roots)) or "none"
    raise WrapError(
        f"amp.init_trainer() looks for the one Gluon net whose parameters are exactly the "
        f"trainer's and found {found}; pass it: amp.init_trainer(trainer, net=net) (a trainer "
        "over part of a net's parameters: build it on net.collect_params() and freeze the "
        "rest with grad_req='null')"
    )


def _descendants(block: gluon.Block) -> Iterator[gluon.Block]:
    for child in children(block).values():
        yield child
        yield from _descendants(child)


def _mixprec_trainer(optimizer_or_trainer: Any, call: str) -> Trainer:
    if isinstance(optimizer_or_trainer, Trainer):
        return optimizer_or_trainer
    if isinstance(optimizer_or_trainer, gluon.Trainer):
        raise StepOrderError(
            f"{call} needs a trainer set up for mixed precision: call "
            "amp.init_trainer(trainer) right after creating it"
        )
    raise WrapError(
        f"{call} takes the gluon.Trainer given to amp.init_trainer(), not "
        f"{type(optimizer_or_trainer).__name__}"
    )


@contextlib.contextmanager
def scale_loss(loss: Any, optimizer_or_trainer: Any) -> Iterator[Any]:
    """Yield ``loss`` (or a list of losses) times the trainer's loss scale, for
    ``autograd.backward``; inside ``autograd.record()`` or right after it.

    The scale is the one the scaler holds now; ``trainer.step`` unscales, checks for
    overflow, skips or steps, and updates it for the very next step.
    """
    trainer = _mixprec_trainer(optimizer_or_trainer, "amp.scale_loss(loss, trainer)")
    with trainer.scale_loss(loss) as scaled:
        yield scaled


def unscale(optimizer_or_trainer: Any) -> None:
    """Reduce the gradients over contexts and divide them by the loss scale, before clipping.

    Under O1 policies (what :func:`init`'s ``target_dtype`` gives) the parameters are float32
    and the optimizer reads their own gradients, so MXNet's recipe (clip
    ``[p.grad(ctx) for p in params]``, then ``trainer.step``) works unchanged. Under O2 the
    optimizer reads float32 master gradients: clip ``trainer.master_grads()`` instead.
    """
    _mixprec_trainer(optimizer_or_trainer, "amp.unscale(trainer)").unscale()


# ---------------------------------------------------------------------- graph conversion


def _refuse(excluded_sym_names: Any, cast_optional_params: bool, call: str) -> None:
    if excluded_sym_names and call == "convert_hybrid_block":
        raise WrapError(
            "excluded_sym_names is not supported for blocks: mixprec keeps blocks, not graph "
            "nodes, in float32. Pin the block: amp.init(policy=mixprec.get_policy('O1-bf16')"
            ".with_module('<block path>', 'float32', match='path')) and train it with "
            "amp.init_trainer, or exclude the nodes in amp.convert_symbol"
        )
    if cast_optional_params:
        raise WrapError(
            f"{call}(cast_optional_params=True) is not supported: O1 keeps float32 "
            "parameters. For low-precision weights (with float32 masters) train under "
            "amp.init(policy='O2-bf16') (or 'O2' on a GPU)"
        )


def convert_hybrid_block(
    block: gluon.HybridBlock,
    target_dtype: Any = "float16",
    target_dtype_ops: Iterable[str] | None = None,
    fp32_ops: Iterable[str] | None = None,
    conditional_fp32_ops: Conditional | None = None,
    excluded_sym_names: Sequence[str] | None = None,
    ctx: Any = None,
    cast_optional_params: bool = False,
) -> gluon.HybridBlock:
    """Make ``block`` run its ops per the AMP lists for ``target_dtype``; returns ``block``.

    Unlike MXNet, which returns a new ``SymbolBlock`` holding copies of the parameters, the
    block is converted *in place* (its graph is cast when traced; parameters stay float32
    and stay trainable), and it need not have run before. A block that has run (MXNet's
    precondition) gets its converted graph at once, for float32 inputs as MXNet's does, so
    ``block.export(...)`` works before the next forward pass. With ``ctx`` its parameters
    move there first. float16 on a CPU context is refused (MXNet has no float16 GEMM there).

    :raises WrapError: not a HybridBlock, ``excluded_sym_names``, ``cast_optional_params``.
    :raises UnsupportedDtypeError: ``target_dtype`` cannot run on the block's context.
    """
    _refuse(excluded_sym_names, cast_optional_params, "convert_hybrid_block")
    if not isinstance(block, gluon.HybridBlock):
        raise WrapError(
            f"convert_hybrid_block takes a HybridBlock, not {type(block).__name__}: build "
            "the net from gluon.nn.HybridSequential / HybridBlock"
        )
    policy = policy_for(target_dtype, target_dtype_ops, fp32_ops, conditional_fp32_ops)
    params = block.collect_params()
    contexts = [ctx] if ctx is not None else next(iter(params.values())).list_ctx()
    policy = resolve_policy(policy, contexts)
    if ctx is not None:
        params.reset_ctx(ctx)
    device = device_key(contexts[0])
    traced = bool(cached_graph(block))
    install_graph_pass(block, policy, device, amp_casts=True)  # Gluon's export drops them
    if traced:  # as MXNet's converted block, it exports before another forward pass
        retrace_graph(block)
    warn_islands(policy.label, policy.compute, device)
    return block


def convert_symbol(
    sym: Symbol,
    target_dtype: Any = "float16",
    target_dtype_ops: Iterable[str] | None = None,
    fp32_ops: Iterable[str] | None = None,
    conditional_fp32_ops: Conditional | None = None,
    excluded_sym_names: Sequence[str] | None = None,
    data_names: Sequence[str] | None = None,
    cast_optional_params: bool = False,
    ctx: Any = None,
) -> Symbol:
    """``sym`` with the casts the AMP lists for ``target_dtype`` ask for (MXNet's graph
    pass with mixprec's lists for ``ctx``, default the current context).

    :param data_names: the inputs that are data, not parameters (default ``["data"]``).
    """
    _refuse(excluded_sym_names, cast_optional_params, "convert_symbol")
    policy = policy_for(target_dtype, target_dtype_ops, fp32_ops, conditional_fp32_ops)
    names = list(data_names) if data_names is not None else ["data"]
    missing = sorted(set(names) - set(sym.list_inputs()))
    if missing:
        raise WrapError(
            f"data_names {missing} are not inputs of the symbol, whose inputs are "
            f"{sym.list_inputs()}; pass data_names=[...] naming its data inputs"
        )
    lists = amp_lists(policy, device_key(ctx or mx.current_context()))
    return reduce_precision(sym, lists, list(excluded_sym_names or ()), names)


def convert_model(
    sym: Symbol,
    arg_params: dict[str, NDArray],
    aux_params: dict[str, NDArray],
    target_dtype: Any = "float16",
    target_dtype_ops: Iterable[str] | None = None,
    fp32_ops: Iterable[str] | None = None,
    conditional_fp32_ops: Conditional | None = None,
    excluded_sym_names: Sequence[str] | None = None,
    cast_optional_params: bool = False,
    ctx: Any = None,
) -> tuple[Symbol, dict[str, NDArray], dict[str, NDArray]]:
    """``(converted symbol, arg_params, aux_params)``: :func:`convert_symbol` with every
    input that is not a parameter taken as data; the parameters are returned as they are
    (float32, as O1 keeps them)."""
    data = [n for n in sym.list_inputs() if n not in arg_params and n not in aux_params]
    converted = convert_symbol(
        sym, target_dtype, target_dtype_ops, fp32_ops, conditional_fp32_ops,
        excluded_sym_names, data, cast_optional_params, ctx,
    )  # fmt: skip
    return converted, arg_params, aux_params


def convert_bucketing_module(bucketing_mod: Any, *args: Any, **kwargs: Any) -> Any:
    """Not supported: mixprec trains Gluon blocks, not the Module API.

    :raises WrapError: always, naming the Gluon route.
    """
    raise WrapError(
        "mixprec does not convert Module-API BucketingModules; build the model as a Gluon "
        "HybridBlock and use amp.convert_hybrid_block / amp.init_trainer (or "
        "mixprec.mxnet.Trainer(net, ..., policy='O1-bf16'))"
    )
