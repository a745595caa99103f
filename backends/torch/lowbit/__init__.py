"""Optimizer state kept in 8 or 4 bits between steps (``state="int8" | "int4" | "fp8"``)."""
