"""``wrap``: the plan (every check, changes nothing), then the model's side of it: parameter
dtypes, boundary and island casting, running statistics, DDP/FSDP2 recipes, and weight
averages of wrapped models. (Not ``wrap/``: a subpackage named like the ``wrap`` function
would replace ``mixprec_torch.wrap`` once imported.)"""
