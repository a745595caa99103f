"""The advisor wing: ``mixprec advise`` and the run both backends share.

The report as plain data (``report``), its PNG plots (``plots``), the judgement over its
rows (``verdicts``), the run itself (``run``) and the ``mixprec advise`` subcommand
(``command``). See ``docs/advisor.md`` and ``docs/architecture.md``.
"""
