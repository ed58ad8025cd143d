"""Warm rank processes: started ahead of need, their imports done, waiting to become a rank.

A new rank process spends seconds starting Python and importing torch and the engine before it can
join a rendezvous, and every other rank of the restarted incarnation waits for it: the replacement of a
killed rank, and the four (ranks_per_node) of a spare taking over a lost node. The executor keeps
`control.standby_ranks` such processes while its ranks train, and ranks_per_node while it is idle (a
spare). Each is `python -m megascale.executor.rank --standby` (rank.py): it imports what a rank needs,
then waits on stdin for its first order, `{"op": "join", "spec": PATH, "log": PATH, "env": {...}}`, points
its output at the rank's log, takes on the rank's environment, and from there on is the rank a new process
started with that spec would be.

They start once the node has been steady for two heartbeat periods while the job's current incarnation
trains (JobTraining): its ranks are in that incarnation, or it has none (idle). Not before: eight ranks importing
torch at a job's start or restart are what the restart waits for, and four more imports beside them (a spare's)
made the main example's first step 3 s later on 2 cores.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import redis

from megascale.common.messages import training_key

from . import log
from .allocator import rank_allocator_env


class Standbys:
    """This node's warm rank processes."""

    def __init__(self, work_dir: Path, training: int, idle: int, settle_s: float):
        """`training`: how many to keep while this node's ranks train; `idle`: while it has none. They start
        once the node has been training (or idle) `settle_s`: before that a restart, or the job's first
        start, is under way, and their imports would compete with its ranks for the CPUs."""
        self.work_dir, self.training, self.idle, self.settle_s = work_dir, training, idle, settle_s
        self.procs: list[subprocess.Popen] = []
        self.steady: Optional[tuple[bool, float]] = None  # (training, since when)

    @property
    def wanted(self) -> bool:
        """Whether this node keeps any, training or idle."""
        return bool(self.training or self.idle)

    def take(self) -> Optional[subprocess.Popen]:
        """A live warm process, no longer this pool's; None when none is ready."""
        while self.procs:
            proc = self.procs.pop(0)
            if proc.poll() is None:
                return proc
            log.warning("standby rank process %d exited with code %s unused", proc.pid, proc.returncode)
        return None

    def refill(self, training: Optional[bool]) -> None:
        """Starts what is missing once the node has been steady `settle_s`. `training`: whether its ranks
        train (True), are absent (False: idle) or are starting or stopped (None: not steady)."""
        now = time.monotonic()
        if training is None or self.steady is None or self.steady[0] != training:
            self.steady = None if training is None else (training, now)
            return
        if now - self.steady[1] < self.settle_s:
            return
        self.procs = [p for p in self.procs if p.poll() is None]
        wanted = self.training if training else self.idle
        while len(self.procs) < wanted:
            self.procs.append(self._spawn())

    def _spawn(self) -> subprocess.Popen:
        with open(self.work_dir / "standby.log", "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "megascale.executor.rank", "--standby"], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
                                    env={**os.environ, **rank_allocator_env()})
        assert proc.stdin is not None
        os.set_blocking(proc.stdin.fileno(), False)  # as a rank's: a process that stopped reading never blocks
        return proc

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()
        self.procs = []


class JobTraining:
    """Whether the job's current incarnation trains, as its driver last wrote (`training_key`): read from Redis at
    most once per `every_s`; while Redis cannot be read, the last answer stands."""

    def __init__(self, client: redis.Redis, job: str, every_s: float):
        self.client, self.key, self.every_s = client, training_key(job), every_s
        self.read_at, self.trains = float("-inf"), False

    def __call__(self) -> bool:
        now = time.monotonic()
        if now - self.read_at >= self.every_s:
            self.read_at = now
            try:
                self.trains = self.client.get(self.key) == b"1"
            except redis.RedisError:
                pass
        return self.trains
