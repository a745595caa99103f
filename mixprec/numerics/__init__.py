"""The numerics wing: the arithmetic of mixed precision as pure state machines and values.

Loss scales (``loss_scale``, ``traced_scale``), the step guard (``guard``), the per-optimizer
stage machine (``stages``), master-weight pairing (``masters``), the compensated master
strategies (``compensated``) and FP8 (``fp8/``: recipes and formats, delayed scaling,
what-if statistics). It imports only the base modules (``errors``, ``dtypes``, ``events``),
never a policy: see the core's wings in ``docs/architecture.md``.
"""
