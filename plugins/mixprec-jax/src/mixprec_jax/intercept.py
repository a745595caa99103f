"""Op-level rules in JAX: the ops a plugin can see, and :func:`policy_scope`, which applies them.

JAX has no hook on every op. A plugin can see two things while a function is traced:

- **flax modules**, through ``flax.linen.intercept_methods``: each module call, with its
  path (``"encoder.Dense_0"``) and class names along the MRO. A module of a mapped class
  (:data:`MODULE_FAMILIES`: ``Dense`` is ``linear``, ``BatchNorm`` is ``batch_norm`` ...)
  asks ``policy.decide`` once; its floating inputs are cast to the answer and its ``dtype``
  field (flax's "dtype of the computation") is set to it for the call, so everything inside
  runs in that dtype. Any other module passes its path and classes on to the ops it calls,
  and a module rule that pins it casts its inputs. A pinned module is an *island* under
  O2/O3 (no op lists): its outputs go back to the dtype around it, so a float32
  ``BatchNorm`` hands bfloat16 to the next layer, as on the torch backend.
- **functions called by name** (:data:`FUNCTION_FAMILIES`): ``jnp.matmul``,
  ``jax.nn.softmax``, ``optax.softmax_cross_entropy_with_integer_labels`` ... are replaced,
  for the duration of the scope, by wrappers that ask ``policy.decide`` and cast their
  floating inputs. A name bound before the scope (``from jax.nn import softmax``) is not.

Inside an op that decided (a mapped module or a wrapped function) nothing decides again:
``jax.nn.softmax`` calls ``jnp.exp``, and that exp belongs to the softmax. What the plugin
cannot see is declared in :data:`mixprec_jax.devices.UNSEEN_OPS` (``x + y``, array methods).

The scope is entered while the loss function is traced (:mod:`mixprec_jax.stepping`), so a
jitted step pays for it once; it is also public, for evaluation code that should run as
training does. Replacing module attributes is process-wide while a scope is open: a lock
keeps scopes from overlapping, and the wrappers act only for the thread that opened it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from mixprec.kit import Policy
from mixprec_jax.casting import cast, dtype_name, is_floating, jax_dtype

__all__ = [
    "FUNCTION_FAMILIES",
    "MODULE_FAMILIES",
    "ModuleSeen",
    "Scope",
    "family_of",
    "module_classes",
    "modules_of",
    "policy_scope",
]

MODULE_FAMILIES: dict[str, str] = {
    "Dense": "linear",
    "DenseGeneral": "linear",
    "Einsum": "linear",
    "Conv": "conv",
    "ConvLocal": "conv",
    "ConvTranspose": "conv_transpose",
    "MultiHeadDotProductAttention": "attention",
    "MultiHeadAttention": "attention",
    "SelfAttention": "attention",
    "SimpleCell": "rnn_cell",
    "GRUCell": "rnn_cell",
    "LSTMCell": "rnn_cell",
    "OptimizedLSTMCell": "rnn_cell",
    "MGUCell": "rnn_cell",
    "BatchNorm": "batch_norm",
    "LayerNorm": "layer_norm",
    "RMSNorm": "layer_norm",
    "GroupNorm": "group_norm",
    "InstanceNorm": "instance_norm",
    "Embed": "embedding",
    "Dropout": "dropout",
}
"""flax.linen module classes (or their subclasses) and the op family each one is."""

FUNCTION_FAMILIES: dict[str, tuple[str, ...]] = {
    "matmul": ("jax.numpy:matmul", "jax.numpy:dot", "jax.numpy:einsum"),
    "softmax": ("jax.nn:softmax", "flax.linen:softmax"),
    "log_softmax": ("jax.nn:log_softmax", "flax.linen:log_softmax"),
    "logsumexp": ("jax.nn:logsumexp", "jax.scipy.special:logsumexp", "flax.linen:logsumexp"),
    "exp": ("jax.numpy:exp",),
    "log": ("jax.numpy:log",),
    "pow": ("jax.numpy:power",),
    "sum": ("jax.numpy:sum",),
    "prod": ("jax.numpy:prod",),
    "cumsum": ("jax.numpy:cumsum",),
    "norm": ("jax.numpy.linalg:norm",),
    "cat": ("jax.numpy:concatenate",),
    "stack": ("jax.numpy:stack",),
    "where": ("jax.numpy:where",),
    "tanh": ("jax.numpy:tanh", "flax.linen:tanh"),
    "relu": ("jax.nn:relu", "flax.linen:relu"),
    "gelu": ("jax.nn:gelu", "flax.linen:gelu"),
    "silu": ("jax.nn:silu", "jax.nn:swish", "flax.linen:silu", "flax.linen:swish"),
    "sigmoid": ("jax.nn:sigmoid", "flax.linen:sigmoid"),
    "max_pool": ("flax.linen:max_pool",),
    "avg_pool": ("flax.linen:avg_pool",),
    "cross_entropy": (
        "optax:softmax_cross_entropy",
        "optax:softmax_cross_entropy_with_integer_labels",
        "optax.losses:softmax_cross_entropy",
        "optax.losses:softmax_cross_entropy_with_integer_labels",
    ),
    "mse_loss": ("optax:l2_loss", "optax:squared_error", "optax.losses:squared_error"),
    "smooth_l1_loss": ("optax:huber_loss", "optax.losses:huber_loss"),
    "kl_div": ("optax:kl_divergence", "optax.losses:kl_divergence"),
    "binary_cross_entropy_with_logits": (
        "optax:sigmoid_binary_cross_entropy",
        "optax.losses:sigmoid_binary_cross_entropy",
    ),
}
"""Each op family the plugin sees as a function, and the ``module:name`` it is called by.
``matmul`` becomes ``bmm`` when an operand has more than two dimensions."""


@dataclass(frozen=True)
class ModuleSeen:
    """One flax module call the scope saw: where, what, and the dtype it ran in."""

    path: str
    classes: tuple[str, ...]
    family: str | None
    dtype: str | None
    """The dtype its op family decided (a mapped module) or a rule pins (None: neither)."""
    output: str | None = None
    """The dtype of its last floating output as it computed it, before any cast back."""


@dataclass
class Scope:
    """The state of one :func:`policy_scope`: the policy, the module stack, what was seen."""

    policy: Policy
    thread: int = field(default_factory=threading.get_ident)
    stack: list[tuple[str, tuple[str, ...], str]] = field(default_factory=list)
    """(path, classes, the dtype around the ops inside) of each open module call."""
    deciding: int = 0
    modules: dict[str, ModuleSeen] = field(default_factory=dict)
    ops: list[tuple[str, str | None, str]] = field(default_factory=list)
    """(op family, module path or None, dtype) for each function the scope cast."""

    def where(self) -> tuple[str | None, tuple[str, ...] | None]:
        """The innermost module's path and classes (None outside every module)."""
        return self.stack[-1][:2] if self.stack else (None, None)

    def around(self) -> str:
        """The dtype around the innermost module: a pinned ancestor's, else ``param``."""
        return self.stack[-1][2] if self.stack else self.policy.param


_lock = threading.RLock()  # re-entrant: a step traced inside a user's scope opens its own
_active: Scope | None = None


def _current() -> Scope | None:
    scope = _active
    if scope is None or scope.deciding or scope.thread != threading.get_ident():
        return None
    return scope


def family_of(classes: Sequence[str]) -> str | None:
    """The op family of a flax module with these class names (MRO order), or None."""
    return next((MODULE_FAMILIES[c] for c in classes if c in MODULE_FAMILIES), None)


def module_classes(module: Any) -> tuple[str, ...]:
    """A flax module's class names along its MRO, up to flax's ``Module``."""
    names = []
    for cls in type(module).__mro__:
        if cls.__module__.startswith("flax.") and cls.__name__ in ("Module", "ModuleBase"):
            break
        names.append(cls.__name__)
    return tuple(names)


def _cast_args(args: Any, dtype: str) -> Any:
    def one(x: Any) -> Any:
        if isinstance(x, list | tuple) and any(is_floating(y) for y in x):
            return type(x)(cast(y, dtype) for y in x)
        return cast(x, dtype)

    return tuple(one(a) for a in args)


def _floating_dtypes(values: Any) -> tuple[str, ...]:
    leaves = jax.tree_util.tree_leaves(values)
    return tuple(dtype_name(x) for x in leaves if is_floating(x))


@contextlib.contextmanager
def _deciding(scope: Scope) -> Iterator[None]:
    scope.deciding += 1
    try:
        yield
    finally:
        scope.deciding -= 1


def _wrap(family: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        scope = _current()
        inputs = _floating_dtypes((args, kwargs))
        if scope is None or not inputs:
            return original(*args, **kwargs)
        op = family
        if family == "matmul" and any(getattr(a, "ndim", 0) > 2 for a in args):
            op = "bmm"
        path, classes = scope.where()
        dtype = scope.policy.decide(op, inputs, module=path, module_class=classes).dtype
        scope.ops.append((op, path, dtype))
        cast_kwargs = {k: cast(v, dtype) for k, v in kwargs.items()}
        with _deciding(scope):
            return original(*_cast_args(args, dtype), **cast_kwargs)

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    wrapper.__name__ = getattr(original, "__name__", family)
    return wrapper


def _interceptor(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
    scope = _current()
    if scope is None or context.method_name != "__call__":
        return next_fun(*args, **kwargs)
    module = context.module
    path, classes = ".".join(str(p) for p in module.path), module_classes(module)
    policy, around = scope.policy, scope.around()
    pinned = policy.module_dtype(path, classes)
    family = family_of(classes)
    if family is None:
        if pinned is not None:
            args = _cast_args(args, pinned)
        scope.modules.setdefault(path, ModuleSeen(path, classes, None, pinned))
        scope.stack.append((path, classes, pinned or around))
        try:
            out = next_fun(*args, **kwargs)
        finally:
            scope.stack.pop()
    else:
        inputs = _floating_dtypes((args, kwargs)) or _floating_dtypes(
            module.variables.get("params")
        )
        dtype = policy.decide(family, inputs, module=path, module_class=classes).dtype
        has_dtype = any(f.name == "dtype" for f in dataclasses.fields(module))
        previous = module.dtype if has_dtype else None
        if has_dtype:  # flax's "dtype of the computation", for this call only
            object.__setattr__(module, "dtype", jax_dtype(dtype))
        try:
            with _deciding(scope):
                out = next_fun(*_cast_args(args, dtype), **kwargs)
        finally:
            if has_dtype:
                object.__setattr__(module, "dtype", previous)
        outputs = _floating_dtypes(out)
        scope.modules[path] = ModuleSeen(path, classes, family, dtype, (outputs or (None,))[-1])
    if path == "":  # the model's boundary: outputs in the policy's output dtype
        return jax.tree_util.tree_map(lambda x: cast(x, policy.output), out)
    if pinned is not None and not policy.casts_ops:
        # an island (O2/O3): the next layer gets the dtype around it, as on the torch backend
        return jax.tree_util.tree_map(lambda x: cast(x, around), out)
    return out


@functools.cache
def _targets() -> tuple[tuple[Any, str, str], ...]:
    """(module object, attribute, family) for every importable function of the table."""
    found = []
    for family, names in FUNCTION_FAMILIES.items():
        for name in names:
            module_name, _, attr = name.partition(":")
            try:
                module = importlib.import_module(module_name)
            except ImportError:  # flax is optional
                continue
            if hasattr(module, attr):
                found.append((module, attr, family))
    return tuple(found)


@contextlib.contextmanager
def policy_scope(policy: Policy) -> Iterator[Scope]:
    """Apply ``policy``'s op and module rules to the JAX code run (or traced) inside.

    Yields the :class:`Scope`, which records the modules and ops it saw. Scopes in
    different threads do not overlap (a lock serialises them); in one thread they nest,
    the innermost policy deciding. The step of :meth:`mixprec_jax.Optimizer.make_step`
    opens one while it traces the loss. Evaluate a trained model under the policy it was
    trained with, so that each module computes in the same dtype:

    Example::

        import flax.linen as nn
        import jax

        import mixprec
        import mixprec.jax as mpj

        model = nn.Sequential([nn.Dense(4), nn.LayerNorm()])
        x = jax.numpy.ones((8, 4))
        params = model.init(jax.random.key(0), x)
        with mpj.policy_scope(mixprec.get_policy("O1-bf16")) as scope:
            out = model.apply(params, x)  # float32 out: O1 casts outputs back
        assert scope.modules["layers_0"].output == "bfloat16"  # the Dense computed in bf16
        assert scope.modules["layers_1"].output == "float32"  # O1 keeps layer_norm fp32
    """
    global _active
    with _lock:
        scope, outer = Scope(policy), _active
        patched = []
        try:
            for module, attr, family in _targets():
                original = getattr(module, attr)
                patched.append((module, attr, original))
                setattr(module, attr, _wrap(family, original))
            _active = scope
            with _flax_interceptor():
                yield scope
        finally:
            _active = outer  # the innermost scope's policy wins while it is open
            for module, attr, original in reversed(patched):
                setattr(module, attr, original)


@contextlib.contextmanager
def _flax_interceptor() -> Iterator[None]:
    try:
        import flax.linen as nn
    except ImportError:  # no flax: functions only
        yield
        return
    with nn.intercept_methods(_interceptor):
        yield


def modules_of(model: Any, *args: Any, **kwargs: Any) -> dict[str, tuple[str, ...]]:
    """The flax modules ``model`` calls on ``args``: path -> class names along the MRO.

    Runs ``model.init`` abstractly (``jax.eval_shape``: no arrays are computed). Pass the
    result as ``Optimizer(..., modules=...)`` when class rules must be known before the
    first step (see :meth:`mixprec_jax.Optimizer.init`).

    Example::

        import flax.linen as nn
        import jax

        import mixprec.jax as mpj

        model = nn.Sequential([nn.Dense(4), nn.LayerNorm()])
        modules = mpj.modules_of(model, jax.numpy.ones((2, 3)))
        assert modules["layers_1"][0] == "LayerNorm"  # path -> classes, most derived first
    """
    import flax.linen as nn

    found: dict[str, tuple[str, ...]] = {}

    def record(next_fun: Callable[..., Any], a: Any, k: Any, context: Any) -> Any:
        if context.method_name == "__call__":
            found[".".join(str(p) for p in context.module.path)] = module_classes(context.module)
        return next_fun(*a, **k)

    with nn.intercept_methods(record):
        jax.eval_shape(lambda *a: model.init(jax.random.key(0), *a, **kwargs), *args)
    return found
