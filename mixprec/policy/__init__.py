"""The policy wing: what a precision policy is, as data and text.

The op vocabulary (``ops``), op lists and module rules (``rules``), rule precedence
(``precedence``), the text grammar (``grammar``), the built-in catalog (``presets``), a
policy's text forms (``forms``), the :class:`~mixprec.Policy` value itself (``value``), the
wrap-time checks (``lint``) and the precision lock file's format (``lockfile``). It reads
the numerics wing and the base modules, never a plugin: see ``docs/architecture.md`` and
``docs/policies.md``.
"""
