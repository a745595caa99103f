"""Compensated bfloat16 weights (``master=kahan|stochastic``) around MXNet's optimizer update.

Below the step: the step runs the strategy's passes (fill before the update, store after it)
and the checkpoints carry its state.
"""
