"""O1 for Gluon: casts inside the hybridized graph (MXNet's ReducePrecision pass with the
policy's lists), and what MXNet's own AMP lists do with each op (for ``mixprec lock``)."""
