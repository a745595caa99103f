import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import mixprec.jax as mpj

x = jax.random.normal(jax.random.key(0), (1024, 20))  # 1024 examples of 20 features
y = (x[:, 0] > 0).astype(jnp.int32)  # a task the model can learn
model = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(2)])
params = model.init(jax.random.key(1), x[:1])


def loss_fn(params, batch):  # params in the policy's dtypes, batch floats in bfloat16
    inputs, labels = batch
    logits = model.apply(params, inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


opt = mpj.Optimizer(optax.adamw(1e-2), policy="O2-bf16")  # or "auto", "O1", "O2"...
state = opt.init(params)  # float32 masters, optax state, loss scale
step = opt.make_step(loss_fn)  # jitted: step(state, batch) -> (loss, state, info)

for i in range(0, 1024, 64):
    batch = (x[i : i + 64], y[i : i + 64])  # shapes (64, 20) and (64,)
    loss, state, info = step(state, batch)  # skips the update if a gradient overflowed
print(f"loss {float(loss):.3f}, skipped steps {int(state.skipped_steps)}")
