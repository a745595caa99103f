import torch
from torch import nn

import mixprec.torch as mp

x = torch.randn(1024, 20)
y = (x[:, 0] > 0).long()  # a task the model can learn
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = mp.wrap(model, optimizer, policy="O2-bf16")  # or "auto", "O1", "O2"...

for batch in torch.randperm(1024).split(64):
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
    with mp.scale_loss(loss, optimizer) as scaled:  # multiplies by the loss scale
        scaled.backward()
    optimizer.step()  # unscales; skips the step if a gradient overflowed
print(f"loss {loss.item():.3f}, skipped steps {mp.state(optimizer).skipped_steps}")
