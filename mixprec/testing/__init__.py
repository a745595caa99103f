"""The conformance suite every mixprec backend runs, built-in or third-party.

A backend's api module returns a :class:`ConformanceAdapter` from ``conformance_adapter()``.
To run the suite, add to the top-level ``conftest.py`` of the backend's tests::

    pytest_plugins = ["mixprec.testing.pytest_plugin"]
    mixprec_backends = ["numpy"]          # or pass --mixprec-backend=numpy

Known gaps go in ``conformance_xfail.txt`` next to the module that defines the adapter, one
``test_id  # reason`` per line; they run as strict xfails. A backend that is asked for but
cannot be built fails the run, it is never skipped. See ``docs/plugins.md``.

Importing this package is cheap: pytest and the suite load only under pytest.
"""

from __future__ import annotations

from mixprec.testing.protocol import ConformanceAdapter, ConformanceTrainer

__all__ = ["ConformanceAdapter", "ConformanceTrainer"]
