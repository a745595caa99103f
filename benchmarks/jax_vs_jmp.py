"""mixprec-jax against DeepMind's jmp: the same flax MLP and optax optimizer on the digits.

Run in the JAX environment (``make test`` or ``make install`` creates ``.venv-jax``)::

    taskset -c 1 .venv-jax/bin/python benchmarks/jax_vs_jmp.py --steps 300 --rounds 5

Contenders, each one jitted training step of the same model (64 -> 512 -> 512 -> 10, ReLU)
with ``optax.adam(1e-3)`` on batches of 256 digits:

- ``float32``: no mixed precision (the reference);
- ``mixprec O2-bf16``: ``mixprec.jax.Optimizer(tx, "O2-bf16")`` and ``make_step``;
- ``jmp``: the policy ``params=float32,compute=bfloat16,output=float32`` with
  ``jmp.DynamicLossScale(2**15)``, written the way jmp's documentation shows: cast the
  params and inputs to compute, the logits to output, scale the loss, unscale the
  gradients, ``jmp.all_finite``, ``loss_scale.adjust``, ``jmp.select_tree``.

First every contender trains ``--steps`` steps from the same initial weights on the same
batches (the loss curves, and the test accuracy after them); then the step time is taken
round-robin: ``--rounds`` rounds, each timing ``--timed`` steps of every contender in turn
(the median of the rounds is reported, with the spread). XLA runs one thread
(``--xla_cpu_multi_thread_eigen=false``), so pin the process to one core.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_cpu_multi_thread_eigen=false"]
).strip()

import flax.linen as nn
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from sklearn.datasets import load_digits

import mixprec.jax as mpj

Step = Callable[[Any, Any], tuple[jax.Array, Any]]


class MLP(nn.Module):
    """64 -> 512 -> 512 -> 10."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Dense(512)(x))
        x = nn.relu(nn.Dense(512)(x))
        return nn.Dense(10)(x)


MODEL = MLP()


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def float32_step(tx: optax.GradientTransformation) -> tuple[Step, Callable[[Any], Any]]:
    @jax.jit
    def step(carry: Any, batch: Any) -> tuple[jax.Array, Any]:
        params, opt_state = carry
        x, y = batch
        loss, grads = jax.value_and_grad(lambda p: cross_entropy(MODEL.apply(p, x), y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, (optax.apply_updates(params, updates), opt_state)

    return step, lambda params: (params, tx.init(params))


def mixprec_step(tx: optax.GradientTransformation) -> tuple[Step, Callable[[Any], Any]]:
    opt = mpj.Optimizer(tx, policy="O2-bf16")

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        x, y = batch
        return cross_entropy(MODEL.apply(params, x), y)

    inner = opt.make_step(loss_fn)

    def step(state: Any, batch: Any) -> tuple[jax.Array, Any]:
        loss, state, _ = inner(state, batch)
        return loss, state

    return step, opt.init


def jmp_step(tx: optax.GradientTransformation) -> tuple[Step, Callable[[Any], Any]]:
    policy = jmp.get_policy("params=float32,compute=bfloat16,output=float32")

    def scaled_loss(params: Any, batch: Any, loss_scale: Any) -> tuple[jax.Array, jax.Array]:
        x, y = batch
        logits = MODEL.apply(policy.cast_to_compute(params), policy.cast_to_compute(x))
        loss = cross_entropy(policy.cast_to_output(logits), y)
        return loss_scale.scale(loss), loss

    @jax.jit
    def step(carry: Any, batch: Any) -> tuple[jax.Array, Any]:
        params, opt_state, loss_scale = carry
        grads, loss = jax.grad(scaled_loss, has_aux=True)(params, batch, loss_scale)
        grads = loss_scale.unscale(policy.cast_to_param(grads))
        finite = jmp.all_finite(grads)
        loss_scale = loss_scale.adjust(finite)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp.select_tree(
            finite, (new_params, new_opt_state), (params, opt_state)
        )
        return loss, (params, opt_state, loss_scale)

    def init(params: Any) -> Any:
        return params, tx.init(params), jmp.DynamicLossScale(jnp.float32(2.0**15))

    return step, init


CONTENDERS: dict[str, Callable[[optax.GradientTransformation], tuple[Step, Any]]] = {
    "float32": float32_step,
    "mixprec O2-bf16": mixprec_step,
    "jmp": jmp_step,
}


def weights_of(name: str, carry: Any) -> Any:
    return carry.weights if name == "mixprec O2-bf16" else carry[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--timed", type=int, default=50)
    args = p.parse_args()

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    x_train, y_train, x_test, y_test = x[:1500], y[:1500], x[1500:], y[1500:]
    batches = []
    rng = np.random.default_rng(1)
    for _ in range(args.steps):
        pick = rng.choice(1500, 256, replace=False)
        batches.append((jnp.asarray(x_train[pick]), jnp.asarray(y_train[pick])))
    params = MODEL.init(jax.random.key(0), batches[0][0])
    tx = optax.adam(1e-3)

    steps, carries, curves = {}, {}, {}
    for name, make in CONTENDERS.items():
        step, init = make(tx)
        carry = init(params)
        losses = []
        for batch in batches:
            loss, carry = step(carry, batch)
            losses.append(float(loss))
        steps[name], carries[name], curves[name] = step, carry, losses

    print(f"devices: {jax.devices()}, jax {jax.__version__}, jmp {jmp.__version__}")
    marks = sorted({0, 10, 25, 50, 100, 200, args.steps - 1} & set(range(args.steps)))
    print("\nloss after step " + " ".join(f"{m:>7}" for m in marks) + "   test accuracy")
    for name, losses in curves.items():
        w = weights_of(name, carries[name])
        logits = np.asarray(MODEL.apply(w, jnp.asarray(x_test)), np.float32)
        accuracy = float(np.mean(np.argmax(logits, -1) == y_test))
        row = " ".join(f"{losses[m]:7.4f}" for m in marks)
        print(f"{name:<16} {row}   {accuracy:.1%}")
    for name in ("mixprec O2-bf16", "jmp"):
        gap = max(abs(a - b) for a, b in zip(curves[name], curves["float32"], strict=True))
        print(f"largest |loss - float32 loss| over the run, {name}: {gap:.4f}")
    same = curves["mixprec O2-bf16"] == curves["jmp"]
    print(f"mixprec O2-bf16 and jmp curves bit-identical: {same}")

    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for _ in range(args.rounds):
        for name, step in steps.items():
            carry = carries[name]
            start = time.perf_counter()
            for i in range(args.timed):
                loss, carry = step(carry, batches[i % len(batches)])
            jax.block_until_ready((loss, carry))
            times[name].append((time.perf_counter() - start) / args.timed)
            carries[name] = carry
    base = statistics.median(times["float32"])
    print(f"\nstep time, median of {args.rounds} round-robin rounds of {args.timed} steps:")
    for name, t in times.items():
        med = statistics.median(t)
        print(f"{name:<16} {med * 1e3:7.3f} ms  ({min(t) * 1e3:.3f}-{max(t) * 1e3:.3f})  "
              f"{base / med:.2f}x float32 speed")  # fmt: skip


if __name__ == "__main__":
    main()
