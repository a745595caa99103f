"""The step: the patched optimizer, the step protocol top to bottom, its data, the
per-step collectives, model edits carried into the masters, checkpoints and the user's loop
calls (``scale_loss``, ``unscale_``, ``master_params``, ``state``)."""
