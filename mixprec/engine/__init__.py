"""The engine wing: policies meet backends.

The hooks (``hookspecs``), the plugin manager and backend lookup (``plugins``), the
``mixprec.<backend>`` facades (``facades``), spec parsing and device resolution (``spec``),
the mutable loss scaler (``scaler``), dtype reports (``diagnostics``) and which op rules a
backend can see (``visibility``). See ``docs/architecture.md`` and ``docs/plugins.md``.
"""
