"""The PyTorch loop with mixprec: O2-bf16, gradient clipping, a checkpoint and a resume."""

import torch
from sklearn.datasets import load_digits
from torch import nn

import mixprec.torch as mp

digits = load_digits()
x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
y = torch.tensor(digits.target)

model = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 10))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
model, optimizer = mp.wrap(model, optimizer, policy="O2-bf16")

for _epoch in range(5):
    for batch in torch.randperm(len(x)).split(64):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x[batch]), y[batch])  # logits come out float32
        with mp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        mp.unscale_(optimizer)  # only needed because we clip
        nn.utils.clip_grad_norm_(mp.master_params(optimizer), max_norm=1.0)
        optimizer.step()  # skips the step if a gradient overflowed

model.eval()
with torch.no_grad():
    accuracy = (model(x).argmax(1) == y).float().mean().item()
state = mp.state(optimizer)
print(f"train accuracy {accuracy:.3f}, skipped {state.skipped_steps}, policy {state.policy}")
assert accuracy > 0.95

# Checkpoints hold float32 master values and the scaler state, whatever the policy.
checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
assert all(t.dtype == torch.float32 for t in checkpoint["model"].values() if t.is_floating_point())

fresh = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 10))
fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=3e-3)
fresh, fresh_opt = mp.wrap(fresh, fresh_opt, policy="O2-bf16")
fresh.load_state_dict(checkpoint["model"])
fresh_opt.load_state_dict(checkpoint["optimizer"])
