"""FP8 linear layers: quantisation and GEMMs, the FP8 ``nn.Linear`` forward and backward,
the delayed-scaling state, ``fp8_statistics``."""
