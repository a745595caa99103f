"""MXNet backend tests: skipped as a whole when MXNet is not installed.

With ``--import-mode=importlib`` test folders are not on ``sys.path``; the shared helpers in
``_mx_nets.py`` are imported by name, so this folder is added.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
