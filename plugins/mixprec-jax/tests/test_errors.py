"""Bad input: a clear MixprecError at Optimizer(...) or init, before anything is traced."""

from __future__ import annotations

import jax
import optax
import pytest
from tests._models import MODEL, batch, params

import mixprec
import mixprec.jax as mpj
from mixprec.errors import MixprecError, PolicyError, UnsupportedDtypeError, WrapError


def _never_traced(p: object, b: object) -> None:
    raise AssertionError("the loss function was traced")


@pytest.mark.parametrize(
    ("policy", "error", "match"),
    [
        (mixprec.get_policy("O1").with_ops(fp32=["add"]), PolicyError, r"cannot see 'add'"),
        (
            mixprec.get_policy("O1-bf16").with_module("head", match="path", ops={"mul": "lowp"}),
            PolicyError,
            r"module rule path:head puts 'mul' in lowp",
        ),
        ("O2,loss_scale=dynamic(on_floor=raise)", PolicyError, "on_floor='warn'"),
        ("O3-bf16-kahan,state=bfloat16", UnsupportedDtypeError, "state=bfloat16"),
    ],
)
def test_a_policy_the_plugin_cannot_honour_is_refused_up_front(
    policy: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        opt = mpj.Optimizer(optax.adam(1e-3), policy=policy)  # type: ignore[arg-type]
        opt.make_step(_never_traced)(opt.init(params()), batch())


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [({"tx": "adam"}, WrapError), ({"seed": -1}, WrapError), ({"device": "gpu:7"}, MixprecError)],
)
def test_bad_arguments(kwargs: dict, error: type[Exception]) -> None:  # type: ignore[type-arg]
    args = {"tx": optax.adam(1e-3), "policy": "O2-bf16", **kwargs}
    with pytest.raises(error):
        mpj.Optimizer(**args)


def test_class_pins_without_masters_need_the_modules() -> None:
    policy = mixprec.get_policy("O3-bf16").with_module("Dense", "float32")
    with pytest.raises(WrapError, match=r"modules=mixprec\.jax\.modules_of"):
        mpj.Optimizer(optax.adam(1e-3), policy).init(params())
    modules = mpj.modules_of(MODEL, batch()[0])
    assert modules["head"][0] == "Dense"
    state = mpj.Optimizer(optax.adam(1e-3), policy, modules=modules).init(params())
    assert {str(x.dtype) for x in jax.tree_util.tree_leaves(state.weights)} == {"float32"}


def test_loss_scaling_without_masters_is_refused() -> None:
    with pytest.raises(WrapError, match="no float32 master copy"):
        mpj.Optimizer(optax.adam(1e-3), "O3,loss_scale=dynamic").init(params())
