"""The NumPy backend runs mixprec's conformance suite: these two lines are all it takes."""

pytest_plugins = ["mixprec.testing.pytest_plugin"]
mixprec_backends = ["numpy"]
