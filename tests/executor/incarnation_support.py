"""What a rank process holds between incarnations (tests of in-process restarts)."""
from __future__ import annotations

import os


def threads_and_fds() -> tuple[int, list[str]]:
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}").split(":")[0])  # socket, pipe, a file's path
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return len(os.listdir("/proc/self/task")), sorted(fds)
