import mxnet as mx
from mxnet import autograd, gluon

import mixprec.mxnet as mpx

x = mx.nd.random.normal(shape=(1024, 20))
y = x[:, 0] > 0  # a task the net can learn
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Dense(64, activation="relu"), gluon.nn.Dense(2))
net.initialize()
trainer = mpx.Trainer(net, "adam", {"learning_rate": 1e-2}, policy="O2-bf16")
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

for i in range(0, 1024, 64):
    with autograd.record():
        loss = loss_fn(net(x[i : i + 64]), y[i : i + 64])
        with trainer.scale_loss(loss) as scaled:  # multiplies by the loss scale
            autograd.backward(scaled)
    trainer.step(64)  # unscales; skips the step if a gradient overflowed
print(f"loss {loss.mean().asscalar():.3f}, skipped steps {trainer.skipped_steps}")
