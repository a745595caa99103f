"""FP8: the formats and recipes with their arithmetic (``recipes``), the delayed recipe's amax
histories (``scaling``) and the what-if statistics a backend records (``stats``).

The FP8 section of ``docs/policies.md`` describes the recipes; ``docs/architecture.md`` the
wing.
"""
