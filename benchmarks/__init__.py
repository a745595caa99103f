"""Side-by-side benchmarks of mixprec against torch.amp and mxnet.contrib.amp.

Run ``python -m benchmarks`` (``--help`` for the options); ``--markdown docs/benchmarks.md``
regenerates the benchmark page. Not a test suite: nothing here asserts, the targets are
evaluated and reported as met or missed.
"""
