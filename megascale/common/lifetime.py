"""Processes that must not outlive their parent: ranks (their executor, or `megascale train`) and a
job's driver (its operator). Otherwise a killed parent leaves them training, or driving, forever."""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, signum: int = signal.SIGKILL) -> None:
    """`signum` to this process when `parent_pid` dies, however it dies (Linux); exits at once if it
    already has (it died before prctl took effect)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum)
    if os.getppid() != parent_pid:
        sys.exit(1)
