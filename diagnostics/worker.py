"""`python -m megascale.diagnostics.worker PARENT_PID`: `megascale diagnose` with its imports done before it is asked.

An executor starts one as a recovery begins (while its ranks stop), so the self-check that follows does not wait
for Python and torch to load, which takes seconds on a busy host. It reads one line, the diagnose arguments as a
JSON list, runs them and exits with their status (0 pass, 1 a check failed, 2 bad input or no request).
"""
from __future__ import annotations

import json
import sys

from megascale.common.lifetime import die_with_parent


def main() -> int:
    die_with_parent(int(sys.argv[1]))
    from .cli import main as diagnose
    from .suite import run_suite  # noqa: F401 - the slow import (torch), done before the request comes

    line = sys.stdin.readline()
    return diagnose(json.loads(line)) if line.strip() else 2


if __name__ == "__main__":
    sys.exit(main())
