"""Other tools' APIs on the Gluon backend: ``mxnet.contrib.amp`` (its op lists and its
training API), behind ``mixprec.compat.mxnet_amp``."""
