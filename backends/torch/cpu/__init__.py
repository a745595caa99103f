"""The C kernels (``_cpu_kernels.c``, loaded by :mod:`.clib`) and their torch twins with
the same bits: the step guard's one-pass unscale and check, counter-based stochastic-rounding
noise."""
