"""Low-bit optimizer state (``state=int8|int4|fp8``): the MXNet optimizer's moments kept
quantized between steps, widened to float32 around its own update.

Below the step: the step decodes the codes before the update and encodes the moments after
it; the states file carries the codes and checks them on load.
"""
