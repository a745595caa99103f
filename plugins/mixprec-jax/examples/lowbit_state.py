import jax
import jax.numpy as jnp
import optax

import mixprec.jax as mpj

params = {"w": jnp.zeros((512, 256)), "b": jnp.zeros(256)}  # 131072 and 256 elements


def loss_fn(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


# AdamW's mu and nu kept as int8 codes between steps: 2.03 bytes a parameter instead of 8
opt = mpj.Optimizer(optax.adamw(1e-3), policy="O2-bf16,state=int8")
state = opt.init(params)
step = opt.make_step(loss_fn)
x = jax.random.normal(jax.random.key(0), (64, 512))
loss, state, info = step(state, (x, x[:, :256]))

mu = state.opt_state[0].mu["w"]  # a QuantizedArray: codes and one absmax per 256 elements
print(mu.codes.dtype, mu.codes.shape, mu.absmax.shape)  # uint8 (131072,) (512,)
print(state.opt_state[0].mu["b"].dtype)  # float32: under min_size (4096), not quantized
