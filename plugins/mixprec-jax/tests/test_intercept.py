"""Op-level rules: flax modules by path and class, jnp/jax.nn/optax functions by name;
what the plugin cannot see is refused or reported."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from tests._models import MODEL, batch, loss_fn, params

import mixprec
import mixprec.jax as mpj


def _dot_dtypes(fn: object, *args: object) -> list[str]:
    """The dtypes of every dot_general in the jaxpr (what XLA is asked to compute in)."""
    jaxpr = jax.make_jaxpr(fn)(*args)  # type: ignore[arg-type]
    eqns = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    return [str(e.outvars[0].aval.dtype) for e in eqns]


def test_module_rules_by_path_reach_flax_modules() -> None:
    policy = mixprec.get_policy("O1-bf16").with_module("head", "float32", match="path")
    x = batch()[0]

    def forward(p: object, x: jax.Array) -> jax.Array:
        with mpj.policy_scope(policy) as scope:
            out = MODEL.apply(p, x)
        assert scope.modules["head"].dtype == "float32"
        assert scope.modules["Dense_0"].dtype == "bfloat16"
        return out

    assert _dot_dtypes(forward, params(), x) == ["bfloat16", "float32"]
    assert _dot_dtypes(MODEL.apply, params(), x) == ["float32", "float32"]  # outside a scope


def test_functions_called_by_name_follow_the_op_lists() -> None:
    x = jnp.ones((4, 3), jnp.bfloat16)
    o1 = mixprec.get_policy("O1-bf16")
    with mpj.policy_scope(o1) as scope:
        assert jax.nn.softmax(x).dtype == jnp.float32  # fp32 list
        assert jnp.matmul(x.astype(jnp.float32), x.T.astype(jnp.float32)).dtype == jnp.bfloat16
        assert jnp.exp(x).dtype == jnp.float32
    assert [op for op, _, _ in scope.ops] == ["softmax", "matmul", "exp"]  # exp inside softmax: no
    with mpj.policy_scope(o1.with_ops(lowp=["softmax"])):
        assert jax.nn.softmax(x.astype(jnp.float32)).dtype == jnp.bfloat16
    assert jax.nn.softmax(x).dtype == jnp.bfloat16  # the scope restored the functions


def test_operators_are_unseen_and_explain_says_so() -> None:
    opt = mpj.Optimizer(optax.adam(1e-3), "O2-bf16")
    text = opt.explain("add")
    assert "jax: cannot see 'add'" in text and "runs it as promote" in text
    assert "jax: applies this rule to flax modules Dense, DenseGeneral, Einsum" in opt.explain(
        "linear"
    )
    state = opt.init(params())
    opt.make_step(loss_fn)(state, batch())
    report = opt.dtype_report(state)
    assert "head     Dense" in report and "add, sub, mul, div: passthrough" in report


def test_o2_batchnorm_runs_float32_inside_a_bfloat16_model() -> None:
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = nn.BatchNorm(use_running_average=True)(nn.Dense(4)(x))
            return nn.Dense(2)(x)

    net, x = Net(), jnp.ones((2, 3))
    variables = net.init(jax.random.key(0), x)
    with mpj.policy_scope(mixprec.get_policy("O2-bf16")) as scope:
        out = net.apply(variables, x.astype(jnp.bfloat16))
    seen = {path: (m.family, m.dtype) for path, m in scope.modules.items()}
    assert seen["BatchNorm_0"] == ("batch_norm", "float32")
    assert seen["Dense_0"] == ("linear", "bfloat16") and seen["Dense_1"] == ("linear", "bfloat16")
    assert out.dtype == jnp.float32  # the model's output dtype
