import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mixprec.jax as mpj

n = jax.local_device_count()  # on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count=2
x = jax.random.normal(jax.random.key(0), (n * 64, 20))  # one step's batch: 64 per device
y = (x[:, 0] > 0).astype(jnp.int32)
model = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(2)])
params = model.init(jax.random.key(1), x[:1])


def loss_fn(params, batch):
    inputs, labels = batch
    logits = model.apply(params, inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


opt = mpj.Optimizer(optax.adamw(1e-2), policy="O2-bf16")

# pmap: a copy of the state on each device, the batch split along a leading device axis
step = jax.pmap(opt.make_step(loss_fn, axis_name="batch"), axis_name="batch")
state = jax.tree_util.tree_map(lambda a: jnp.stack([a] * n), opt.init(params))
batch = (x.reshape(n, 64, 20), y.reshape(n, 64))  # shapes (n, 64, 20) and (n, 64)
for _ in range(10):
    loss, state, info = step(state, batch)  # gradients averaged; one overflow skips all
print(f"pmap, {n} device(s): loss {float(loss[0]):.3f}, skipped {int(state.skipped_steps[0])}")

# shard_map: the same step built with jit=False, the batch sharded over a mesh axis
mesh = jax.make_mesh((n,), ("batch",))
sharded = jax.shard_map(
    opt.make_step(loss_fn, axis_name="batch", jit=False),
    mesh=mesh,
    in_specs=(P(), P("batch")),  # state replicated, batch split along its first axis
    out_specs=(P(), P(), P()),
)
step = jax.jit(sharded)
state = jax.device_put(opt.init(params), NamedSharding(mesh, P()))  # on every device
batch = jax.device_put((x, y), NamedSharding(mesh, P("batch")))  # (n * 64, 20), (n * 64,)
for _ in range(10):
    loss, state, info = step(state, batch)
print(f"shard_map, {n} device(s): loss {float(loss):.3f}, skipped {int(state.skipped_steps)}")
