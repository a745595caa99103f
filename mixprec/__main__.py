"""``python -m mixprec``: the ``mixprec`` command, run as ``python -m mixprec.cli`` runs it.

By name (``runpy``), not by import: this module sits on the lowest floor of the core.
"""

import runpy

runpy.run_module("mixprec.cli", run_name="__main__", alter_sys=True)
