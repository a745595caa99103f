"""``mixprec.jax.Optimizer``: mixed precision around an optax optimizer, shaped like optax.

::

    import mixprec.jax as mpj
    opt = mpj.Optimizer(optax.adamw(1e-3), policy="O2-bf16")
    state = opt.init(params)                # float32 masters, optax state, loss scale
    step = opt.make_step(loss_fn)           # jitted: loss_fn(params, batch) -> loss
    loss, state, info = step(state, batch)  # info.skipped, info.loss_scale
    params = opt.params(state)              # the float32 masters

The optimizer holds configuration only (the policy, the optax transformation); everything
that changes lives in the :class:`~mixprec_jax.state.State` pytree, so steps are pure.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

import jax
import jax.numpy as jnp
import optax

from mixprec.errors import WrapError
from mixprec.kit import (
    KAHAN,
    STOCHASTIC,
    Policy,
    check_scaler_without_masters,
    check_seed,
    initial_scale,
    parse_state_format,
)
from mixprec_jax import checkpoint, compensation, diagnostics, lowbit
from mixprec_jax.casting import PyTree, cast, to_float32
from mixprec_jax.devices import resolve_policy
from mixprec_jax.state import ScaleArrays, State, StepInfo
from mixprec_jax.stepping import LossFn, build_step, forward_params, stored_dtype_problems
from mixprec_jax.trees import Modules, has_class_pins, leaf_names, param_dtypes

__all__ = ["Optimizer"]

Step = Callable[[State, PyTree], tuple[jax.Array, State, StepInfo]]


class Optimizer:
    """An optax optimizer under a mixprec policy.

    Example::

        import flax.linen as nn
        import jax
        import optax

        import mixprec.jax as mpj

        model = nn.Dense(2)
        x, y = jax.numpy.ones((8, 4)), jax.numpy.zeros(8, jax.numpy.int32)  # a batch of 8
        params = model.init(jax.random.key(0), x)


        def loss_fn(params, batch):
            inputs, labels = batch
            logits = model.apply(params, inputs)  # a bfloat16 Dense under O2-bf16
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


        opt = mpj.Optimizer(optax.adamw(1e-3), policy="O2-bf16")
        state = opt.init(params)
        step = opt.make_step(loss_fn)
        loss, state, info = step(state, (x, y))
        assert not info.skipped and int(state.steps) == 1
        assert opt.params(state)["params"]["kernel"].dtype == jax.numpy.float32  # masters

    :param tx: the optax ``GradientTransformation`` (``optax.adamw(1e-3)``, a chain ...).
    :param policy: any policy spec (``"O2-bf16"``, ``"O1"``, ``"auto"``, a key-grammar
        string, a dict, a TOML path or a :class:`~mixprec.Policy`).
    :param device: the device the policy is resolved and checked for, as
        ``capabilities()`` names it (``"cpu"``, ``"gpu:0"``); default: JAX's default
        device.
    :param modules: module path -> class names (:func:`mixprec_jax.modules_of`), for class
        rules that must be known before the first step (see :meth:`init`).
    :param seed: seeds the stochastic rounding of ``master=stochastic``.
    :raises MixprecError: before anything is traced, for a policy the device or the plugin
        cannot honour (a dtype the device lacks, a rule on an op the plugin cannot see,
        ``on_floor="raise"``, ``state=bfloat16``), a bad seed, or a ``tx`` that is not an
        optax transformation. Under a low-bit ``state`` (``state=int8``, ``int4``, ``fp8``)
        ``tx`` is wrapped in :func:`~mixprec_jax.quantized_state`, and :meth:`init`
        refuses an optimizer whose state it cannot quantize.
    """

    def __init__(
        self,
        tx: optax.GradientTransformation,
        policy: str | Policy | Mapping[str, Any] = "auto",
        *,
        device: str | None = None,
        modules: Modules | None = None,
        seed: int = 0,
    ) -> None:
        if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
            raise WrapError(
                f"Optimizer needs an optax GradientTransformation (with init and update), got "
                f"{type(tx).__name__}; pass e.g. optax.adamw(1e-3)"
            )
        self.seed = check_seed(seed)
        if device is None:
            default = jax.devices()[0]
            device = f"{default.platform}:{default.id}"
        self.device = device
        self.policy: Policy = resolve_policy(policy, device)  # type: ignore[arg-type]
        #: The low-bit state format of the policy, or None.
        self.state_format = parse_state_format(self.policy.state) if self.policy.state else None
        #: ``tx``, wrapped in :func:`~mixprec_jax.quantized_state` under a low-bit ``state``.
        self.tx = tx if self.state_format is None else lowbit.quantized_state(tx, self.state_format)
        self.modules: Modules | None = None if modules is None else dict(modules)
        #: The modules the last traced step saw (path -> classes), for :meth:`dtype_report`.
        self.seen_modules: Modules | None = self.modules

    def __repr__(self) -> str:
        return f"mixprec.jax.Optimizer(policy={str(self.policy)!r}, device={self.device!r})"

    # ------------------------------------------------------------------ state

    def init(self, params: PyTree, *, model_state: PyTree = None) -> State:
        """The first :class:`~mixprec_jax.state.State` for ``params`` (float32, as
        ``model.init`` returns them).

        Under a policy with float32 masters the state keeps float32 copies and the forward
        pass reads them cast per module; without masters (O0, O1, O3) and under a
        compensated strategy the state keeps the parameters in the dtype the policy gives
        each module. A class rule that pins such a module (``class:*BatchNorm*=float32``
        under O3) needs the classes before the first step: build the optimizer with
        ``modules=mixprec.jax.modules_of(model, x)``.

        :param model_state: non-trainable variables (flax ``batch_stats``); the loss
            function then is ``loss_fn(params, batch, model_state) -> (loss, new_state)``
            and a skipped step keeps them as they were.
        :raises WrapError: a parameter is not a floating array, or the classes are needed
            and missing; under a low-bit ``state``, an optax optimizer whose per-parameter
            state is not Adam's, AMSGrad's or SGD's momentum (:data:`mixprec_jax.lowbit
            .SUPPORTED`).
        """
        policy = self.policy
        if self.modules is None and has_class_pins(policy) and not policy.uses_masters:
            raise WrapError(
                f"policy {policy.label} pins modules by class ("
                + ", ".join(f"{r.match}:{r.pattern}" for r in policy.modules)
                + ") and keeps no float32 masters, so the dtype each parameter is stored in "
                "depends on its module's class, which a parameter tree does not hold. Pass "
                "modules=mixprec.jax.modules_of(model, example_input) to Optimizer(...)"
            )
        dtypes = param_dtypes(policy, params, self.modules)
        leaves, treedef = jax.tree_util.tree_flatten(params)
        if policy.uses_masters:
            weights = to_float32(params)  # exact masters: copied before any cast
        else:
            weights = treedef.unflatten([cast(p, d) for p, d in zip(leaves, dtypes, strict=True)])
            check_scaler_without_masters(
                policy,
                [n for n, d in zip(leaf_names(params), dtypes, strict=True) if d != "float32"],
            )
        strategy = policy.master_strategy
        comp = rng = None
        if strategy == KAHAN:
            comp = jax.tree_util.tree_map(
                lambda w: jnp.zeros_like(w) if w.dtype == jnp.bfloat16 else jnp.zeros((), w.dtype),
                weights,
            )
        elif strategy == STOCHASTIC:
            rng = compensation.new_key_data(self.seed)
        state = State(weights=weights, opt_state=None, loss_scale=_scale_arrays(policy),
                      steps=jnp.int32(0), skipped_steps=jnp.int32(0), compensation=comp,
                      rng=rng, model_state=model_state)  # fmt: skip
        working = compensation.working_values(strategy, weights, comp) if strategy else weights
        return state._replace(opt_state=self.tx.init(working))

    def params(self, state: State) -> PyTree:
        """The best values the optimizer knows: the float32 masters; ``w + c`` in float32
        under ``master=kahan``; the stored parameters otherwise."""
        if self.policy.master_strategy == KAHAN:
            return compensation.working_values(KAHAN, state.weights, state.compensation)
        return state.weights

    def model_params(self, state: State) -> PyTree:
        """The parameters as the forward pass reads them (each in its module's dtype)."""
        return forward_params(self, state, param_dtypes(self.policy, state.weights, self.modules))

    # ------------------------------------------------------------------ the step

    def make_step(self, loss_fn: LossFn, *, axis_name: str | None = None, jit: bool = True) -> Step:
        """The training step ``step(state, batch) -> (loss, state, info)``.

        ``loss_fn(params, batch)`` receives the parameters in the policy's param dtypes and
        the batch's floating leaves in its compute dtype, and returns a scalar loss (with
        ``model_state``: see :meth:`init`). The step scales the loss, unscales and checks
        the gradients, applies optax's update to the float32 working values or skips the
        step (masters, optax state and model state unchanged), and moves the loss scale
        exactly as :class:`mixprec.DynamicScale` does.

        :param axis_name: the ``jax.pmap``/``shard_map`` axis the batch is split over: the
            gradients (in the policy's ``reduce`` dtype) and the loss are averaged over it,
            and the skip decision is taken on all devices at once.
        :param jit: compile the step with ``jax.jit`` (default); under ``pmap`` either way
            works.
        """
        if not callable(loss_fn):
            raise WrapError(f"make_step needs a loss function, got {type(loss_fn).__name__}")
        step = build_step(self, loss_fn, axis_name)
        return jax.jit(step) if jit else step

    def check_stored_dtypes(self, state: State, dtypes: list[str], modules: Modules | None) -> None:
        """Refuse a state whose stored weights do not have the dtypes the policy gives
        them (called while the step is traced)."""
        if self.policy.uses_masters:
            return
        problems = stored_dtype_problems(state, dtypes)
        if problems:
            raise WrapError(
                f"the state's weights are not stored as policy {self.policy.label} says: "
                + "; ".join(problems[:3])
                + ". Was the state made by another Optimizer? If a class rule pins these "
                "modules, pass modules=mixprec.jax.modules_of(model, example_input) to "
                "Optimizer(...) before init"
            )

    # ------------------------------------------------------------------ files and reports

    def save(self, file: str | IO[bytes], state: State) -> None:
        """Write ``state`` (every array, exactly), the policy and SHA-256 checksums to one
        ``.npz`` file, atomically (a crash mid-save leaves the previous file)."""
        checkpoint.save(file, state, self.policy)

    def load(self, file: str | IO[bytes], like: State) -> State:
        """The state :meth:`save` wrote, shaped like ``like`` (``opt.init(params)``).

        The file is read as untrusted data (:mod:`mixprec_jax.checkpoint`): sizes are
        checked before anything is inflated, the checksums, the policy and every array's
        name, shape and dtype before the state is built, and inf/NaN values are refused.
        Files written before the checksums (format ``mixprec-jax/1``) still load.

        :raises CheckpointError: another policy, arrays that do not match ``like``, inf or
            NaN values, or a file that is not a checkpoint of this plugin (named when it is
            a Gluon, PyTorch, pickle or ``.npy`` file) or is empty, truncated, oversized or
            damaged; nothing is returned half-loaded.
        """
        state = checkpoint.load(file, like, self.policy)
        if self.state_format is not None:
            lowbit.check_codes(state.opt_state, self.state_format)
        return state

    def save_params(self, file: str | IO[bytes], state: State) -> None:
        """Write :meth:`params` to a ``.npz`` file, float32 wherever the policy keeps more
        than the parameters' precision (masters, compensated weights)."""
        checkpoint.save_params(file, self.params(state), self.policy)

    def explain(
        self,
        op: str,
        input_dtypes: Sequence[str] = (),
        module: str | None = None,
        module_class: str | Sequence[str] | None = None,
    ) -> str:
        """:meth:`mixprec.Policy.explain`, plus whether the JAX backend can apply the rule."""
        return diagnostics.explain(self.policy, op, input_dtypes, module, module_class)

    def dtype_report(self, state: State) -> str:
        """Each module's parameter dtype, compute dtype and the rule behind them, then the
        rules the plugin cannot apply (classes come from ``modules`` or the last traced
        step)."""
        return diagnostics.dtype_report(self.policy, state.weights, self.seen_modules)


def _scale_arrays(policy: Policy) -> ScaleArrays:
    scale, good, left = initial_scale(policy.loss_scale)
    return ScaleArrays(jnp.float32(scale), jnp.int32(good), jnp.int32(left))
