"""``master=kahan|stochastic`` and ``state="bfloat16"``: bfloat16 weights with compensation
or stochastic rounding instead of float32 masters, and the optimizer state kept in bfloat16
between steps."""
