"""A backend's list of known conformance gaps: ``conformance_xfail.txt``.

The file sits next to the module that defines the backend's adapter. One entry per line::

    test_op_dtype_matches_decide[O1-cumsum]   # cumsum has no native float16 kernel here

The id is the suite's test name with its parameters but without the backend (what pytest
shows, minus the leading ``backend-``); shell-style wildcards (``*``, ``?``) are allowed.
Everything from ``#`` on is the reason. Entries run as *strict* xfails: a listed test that
passes fails the run, and an entry that names no test fails ``test_xfail_file_is_current``.
"""

from __future__ import annotations

import fnmatch
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["XFAIL_FILENAME", "XfailEntry", "parse_xfail_file", "xfail_file_for"]

XFAIL_FILENAME = "conformance_xfail.txt"


@dataclass(frozen=True)
class XfailEntry:
    """One line of the file: a test id (or pattern) and why it is expected to fail."""

    pattern: str
    reason: str
    line: int

    def matches(self, test_id: str) -> bool:
        """Whether this entry names ``test_id`` (exactly or as a wildcard pattern)."""
        # brackets in test ids are literal, not fnmatch character classes
        escaped = "".join({"[": "[[]", "]": "[]]"}.get(c, c) for c in self.pattern)
        return self.pattern == test_id or fnmatch.fnmatchcase(test_id, escaped)


def parse_xfail_file(text: str) -> list[XfailEntry]:
    """The entries of a ``conformance_xfail.txt`` text (blank and comment lines skipped)."""
    entries = []
    for number, raw in enumerate(text.splitlines(), start=1):
        pattern, _, reason = raw.partition("#")
        pattern = pattern.strip()
        if not pattern:
            continue
        if " " in pattern or "\t" in pattern:
            raise ValueError(
                f"{XFAIL_FILENAME} line {number}: {raw.strip()!r} holds more than one test id; "
                "write one id per line, then '# reason'"
            )
        entries.append(XfailEntry(pattern, reason.strip() or f"listed in {XFAIL_FILENAME}", number))
    return entries


def xfail_file_for(obj: object) -> Path | None:
    """Where the xfail file of the backend whose adapter is ``obj`` lives (None: not a file
    system module, such as an adapter defined in a test)."""
    module = sys.modules.get(type(obj).__module__)
    filename = getattr(module, "__file__", None)
    return Path(filename).with_name(XFAIL_FILENAME) if filename else None
