"""A slow-rank fault (`megascale chaos slow-rank`): one rank's process made `factor` times slower.

The rank is stopped and resumed (SIGSTOP / SIGCONT) in a duty cycle: it runs 1/factor of every
`PERIOD_S` and is stopped for the rest, so everything it does takes `factor` times as long in wall
time, as on a slow device or a throttled CPU, with no help from the rank. The
phases are measured, and each next one corrects the error of those before, so the achieved share
of stopped time stays on target however late this thread is woken on a busy host.
"""
from __future__ import annotations

import math
import os
import signal
import threading
import time
from typing import Optional

import redis

from megascale.common.messages import MessageError, SlowRank, decode, slow_ranks_key

from . import log
from .ranks import RankGroup

PERIOD_S = 0.1  # short against a step, so every step is slowed by about the same factor


class Throttle:
    """Throttles one process by `factor` (> 1) until `until` (time.time()), `stop()` or the process ends."""

    def __init__(self, pid: int, factor: float, until: float):
        if factor <= 1.0:
            raise ValueError(f"factor must be above 1, not {factor}")
        self.pid, self.factor, self.until = pid, factor, until
        self.stopped_s = 0.0  # time spent stopped, and in all
        self.elapsed_s = 0.0
        self._quit = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"throttle-{pid}", daemon=True)

    def start(self) -> "Throttle":
        self._thread.start()
        return self

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Ends the throttle and leaves the process running."""
        self._quit.set()
        self._thread.join()

    def _signal(self, sig: int) -> bool:
        try:
            os.kill(self.pid, sig)
            return True
        except ProcessLookupError:
            return False

    def _run(self) -> None:
        share = 1.0 - 1.0 / self.factor  # of wall time, stopped
        started = time.monotonic()
        try:
            while not self._quit.is_set() and time.time() < self.until:
                # The next period's stop makes the running total hit the target share at its end.
                stop_for = max(0.0, share * (self.elapsed_s + PERIOD_S) - self.stopped_s)
                began = time.monotonic()
                if stop_for > 0:
                    if not self._signal(signal.SIGSTOP):
                        return
                    self._quit.wait(stop_for)
                    if not self._signal(signal.SIGCONT):
                        return
                resumed = time.monotonic()
                self.stopped_s += resumed - began
                self._quit.wait(max(0.0, PERIOD_S - (resumed - began)))
                self.elapsed_s = time.monotonic() - started
        finally:
            self._signal(signal.SIGCONT)  # never leave it stopped
            log.info("throttle of pid %d by %.2fx ended: stopped %.1f of %.1f s", self.pid, self.factor,
                     self.stopped_s, self.elapsed_s)


class SlowRanks:
    """The node's slow-rank faults, as `megascale chaos slow-rank` records them in Redis: looked up once a
    second, applied to the local ranks they name (again to a restarted rank: the device is still slow),
    ended when they expire or are cleared."""

    CHECK_S = 1.0

    def __init__(self, redis_client: redis.Redis, job: str, node: str):
        self.redis, self.key = redis_client, slow_ranks_key(job, node)
        self.throttles: dict[int, Throttle] = {}  # by global rank
        self._checked = 0.0

    def apply(self, group: Optional[RankGroup]) -> None:
        now = time.monotonic()
        if now - self._checked < self.CHECK_S:
            return
        self._checked = now
        try:
            raw = self.redis.hgetall(self.key)
        except redis.RedisError:
            return  # the command loop reports outages; the faults wait for Redis
        wanted = {}
        for value in raw.values():
            try:
                fault = decode(value, expect=SlowRank)
            except MessageError as e:
                log.warning("ignored a malformed slow-rank fault: %s", e)
                continue
            if fault.until is None or fault.until > time.time():
                wanted[fault.rank] = fault
        pids = {p.rank: p.proc.pid for p in group.procs if p.proc.poll() is None} if group else {}
        for rank, throttle in list(self.throttles.items()):
            fault = wanted.get(rank)
            if not throttle.alive() or pids.get(rank) != throttle.pid or fault is None or \
                    (fault.factor, fault.until or math.inf) != (throttle.factor, throttle.until):
                throttle.stop()
                del self.throttles[rank]
        for rank, fault in wanted.items():
            if rank in pids and rank not in self.throttles and fault.factor > 1:
                log.info("slowing rank %d (pid %d) by %.2fx", rank, pids[rank], fault.factor)
                self.throttles[rank] = Throttle(pids[rank], fault.factor, fault.until or math.inf).start()

    def stop(self) -> None:
        """Ends every throttle, leaving the ranks running (before they are stopped: a rank stopped again
        after its SIGTERM could not exit)."""
        for throttle in self.throttles.values():
            throttle.stop()
        self.throttles.clear()
