"""O1: op-level casting. The policy's op table as kernels at torch's Autocast dispatch keys,
the regions they read, the decisions they look up, the probes that find what torch.autocast
does, and autocast switched around islands, compiled frames and checkpoint recomputation."""
