import flax.linen as nn
import jax
import optax

import mixprec
import mixprec.jax as mpj

model = nn.Sequential([nn.Dense(64), nn.LayerNorm(), nn.relu, nn.Dense(2)])
x = jax.numpy.ones((8, 20))  # a batch: 8 examples of 20 features
params = model.init(jax.random.key(0), x)
modules = mpj.modules_of(model, x)  # module path -> class, for the class rules
opt = mpj.Optimizer(optax.adamw(1e-3), policy="policy.toml", modules=modules)  # the file
assert opt.policy == mixprec.load_toml("policy.toml")
print(opt.explain("softmax", ["bfloat16"]).splitlines()[-2])  # Result: float32, by ...
print(opt.dtype_report(opt.init(params)))  # layers_1 (LayerNorm): float32 params
