import torch

import mixprec
import mixprec.torch as mp

model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.LayerNorm(64),
                            torch.nn.ReLU(), torch.nn.Linear(64, 2))  # fmt: skip
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = mp.wrap(model, optimizer, policy="policy.toml")  # the same file
assert mp.state(optimizer).policy == mixprec.load_toml("policy.toml")
print(mp.dtype_report(model))  # 1 (LayerNorm): float32 params
