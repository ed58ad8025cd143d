"""`MEGASCALE_DRIVER_CRASH_AT=stop,diagnose,evict,start`: the driver kill -9s itself the first time it reaches
each named point of a recovery, so a test (or a soak run) can check that the driver the supervisor restarts
resumes every phase from the job record, as it must after an OOM kill or a lost machine.

Points: a command phase's op (`flight`, `stop`, `diagnose`, `start`: after its first node was sent the command,
before the others were) and `evict` (after an eviction was saved, before the restart was decided). Each point
fires once per job: Redis remembers it, so the restarted driver, which inherits the variable, goes on. The
variable comes from the job owner's environment, like every other setting of the supervisor.
"""
from __future__ import annotations

import os
import signal

from . import log
from .state import JobStore

ENV = "MEGASCALE_DRIVER_CRASH_AT"


def reach(store: JobStore, point: str) -> None:
    wanted = os.environ.get(ENV)
    if not wanted or point not in wanted.split(","):
        return
    if store.r.sadd(f"megascale:{{{store.job}}}:crashpoints", point):
        log.warning("crash point %r reached: kill -9 of this driver (%s)", point, ENV)
        os.kill(os.getpid(), signal.SIGKILL)
