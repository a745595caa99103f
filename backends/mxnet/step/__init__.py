"""The Gluon Trainer's step and what it reads and writes: the data-only trainer state, the
``grad_req='add'`` sums, the kvstore, BatchNorm statistics put back on a skip, the optimizer
mixprec registers, and the checkpoints (parameters, trainer states and their file format)."""
