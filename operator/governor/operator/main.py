"""`governor operator [kopf run flags]`: the kopf operator for InferenceService, standalone (no peering)."""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    args = list(argv) or ["--all-namespaces"]
    os.execvp(sys.executable, [sys.executable, "-m", "kopf", "run", "--standalone", "-m", "governor.operator.handlers",
                               *args])
    return 0  # not reached
