"""The host's own speed through a soak, apart from the job: a process of its own times a fixed piece of
pure-Python work every second at real-time priority (SCHED_FIFO, granted to root), so that no process of
the job can take its turn. What it measures is what the CPU gives when it runs (the hypervisor's share
of a virtual machine's cores, the clock, the caches the job's ranks also use); a step-time drift that the
probe shows too is the host's, not something building up in the job. Without real-time priority it still
runs, but waits its turn behind the ranks, and `realtime` says so.

`python -m megascale.bench.host_probe PARENT_PID` prints `wall_time seconds` a line until its parent dies.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

from megascale.common.lifetime import die_with_parent

EVERY_S = 1.0
REPEATS = 2  # the faster of two: an interrupt in one is not the host's speed
WORK_ITERATIONS = 200_000  # ~8 ms on this host: 1.6% of one core
PRIORITY = 10  # low among real-time priorities: the kernel's own threads and watchdogs keep theirs
NOT_REALTIME = "not-realtime"  # the first line of a probe that was refused real-time priority


def _work_s() -> float:
    started, total = time.perf_counter(), 0
    for i in range(WORK_ITERATIONS):
        total += i * i
    return time.perf_counter() - started


def main(argv: list[str]) -> int:
    die_with_parent(int(argv[0]))  # a real-time loop must not outlive the soak that reads it
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(PRIORITY))
    except PermissionError:
        print(NOT_REALTIME, flush=True)
    while True:
        print(f"{time.time():.3f} {min(_work_s() for _ in range(REPEATS)):.6f}", flush=True)
        time.sleep(EVERY_S)


class HostProbe:
    """The probe's samples, (wall time, seconds), read from its output file; `pid`, its process."""

    def __init__(self, out: Path, pid: int):
        self.out, self.pid = out, pid

    def samples(self) -> list[tuple[float, float]]:
        lines = self.out.read_text().split("\n") if self.out.exists() else []
        return [(float(t), float(s)) for t, s in (line.split() for line in lines if line and line != NOT_REALTIME)]

    def realtime(self) -> bool:
        return not (self.out.exists() and self.out.read_text().startswith(NOT_REALTIME))


@contextlib.contextmanager
def host_probe(out: Path) -> Iterator[HostProbe]:
    """The probe running, writing to `out`, for the block; stopped at its end."""
    with open(out, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "megascale.bench.host_probe", str(os.getpid())],
                                stdout=sink, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        yield HostProbe(out, proc.pid)
    finally:
        proc.kill()
        proc.wait()


def median_between(samples: list[tuple[float, float]], start: float, end: float, least: int = 3) -> Optional[float]:
    """The probe's median time over samples taken in [start, end]; None with fewer than `least`."""
    inside = [s for t, s in samples if start <= t <= end]
    return statistics.median(inside) if len(inside) >= least else None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
