"""One node's ranks for one job incarnation: spawn, watch, tail their logs for errors, stop.

Each rank writes one log (stdout and stderr) and a progress file of JSON lines (`rank.py`):
`{"state": "running"}` once its process group is up, one line of step statistics per step on
the reporting rank, `{"state": "done"}` at the end. Files, not pipes, so a slow executor never
blocks a rank and the record survives for `megascale logs`.
"""
from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

from megascale.common.messages import ErrorLine, RankState, RankStatus

from . import log
from megascale.common.rankspec import RankSpec

# Set to a script path to run it instead of the training entry point (tests: fake ranks).
RANK_ENTRY_ENV = "MEGASCALE_RANK_ENTRY"
RECENT_ERRORS = 10

# First match wins: the specific patterns before the generic exception line.
ERROR_PATTERNS: list[tuple[str, re.Pattern]] = [
    ("nccl_timeout", re.compile(r"Watchdog caught collective operation timeout|NCCL.*time(d)? ?out", re.I)),
    ("oom", re.compile(r"out of memory|OutOfMemoryError|\bMemoryError\b|Cannot allocate memory")),
    ("cuda_error", re.compile(r"CUDA error|CUBLAS_STATUS|cudaError|device-side assert")),
    ("comm_error", re.compile(r"NCCL (WARN|error)|nccl\w*Error|Connection (closed|reset) by peer|"
                              r"DistNetworkError|DistStoreError|Rendezvous(Error|Timeout)|"
                              r"Gloo.*(timed out|closed)", re.I)),
    ("python_exception", re.compile(r"^([A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(Error|Exception|Interrupt|Exit)\b(:|$)")),
]


# torch.distributed prefixes a failing rank's traceback lines with "[rank3]: ".
TORCH_PREFIX = re.compile(r"^\[rank\d+\]:\s?")


def classify(line: str) -> Optional[str]:
    """The ErrorKind of a rank log line, or None for an ordinary line."""
    line = TORCH_PREFIX.sub("", line)
    for kind, pattern in ERROR_PATTERNS:
        if pattern.search(line):
            return kind
    return None


@dataclass
class RankProcess:
    rank: int
    local_rank: int
    proc: subprocess.Popen
    log_path: Path
    progress_path: Path
    stopping: bool = False
    log_offset: int = 0
    progress_offset: int = 0
    running: bool = False  # its process group is up
    done: bool = False
    last: dict = field(default_factory=dict)  # newest step statistics
    validated: dict = field(default_factory=dict)  # val_step, val_loss, val_ppl of its newest validation
    restored_step: Optional[int] = None  # the step it started from, once known
    waiting: Optional[tuple[str, float]] = None  # (what, since when) it is blocked on outside a step

    def state(self) -> RankState:
        return self.state_at(self.proc.poll())

    def state_at(self, code: Optional[int]) -> RankState:
        """Its state given its exit code as polled (None: still running)."""
        if code is None:
            return "running" if self.running else "starting"
        if code == 0 and self.done:
            return "succeeded"
        return "stopped" if self.stopping else "failed"

    def status(self) -> RankStatus:
        return RankStatus(rank=self.rank, local_rank=self.local_rank, state=self.state(), pid=self.proc.pid,
                          exit_code=self.proc.poll(), step=self.last.get("step"),
                          step_time=self.last.get("step_time"), loss=self.last.get("loss"))


class RankGroup:
    """The ranks one `start` command asked for. `poll()` reports whether anything a heartbeat shows changed."""

    def __init__(self, work_dir: Path, spec: RankSpec, ranks: list[int], env: dict[str, str]):
        self.incarnation = incarnation = spec.incarnation
        self.dir = work_dir / f"incarnation-{incarnation}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.errors: collections.deque[ErrorLine] = collections.deque(maxlen=RECENT_ERRORS)
        self.steps: list[dict] = []  # step lines not yet published as metrics
        self.procs: list[RankProcess] = []
        for local_rank, rank in enumerate(ranks):
            self.procs.append(self._spawn(work_dir, spec, rank, local_rank, len(ranks), env))
        self._states = [p.state() for p in self.procs]

    def _spawn(self, work_dir: Path, spec: RankSpec, rank: int, local_rank: int, local_world: int,
               env: dict[str, str]) -> RankProcess:
        progress = self.dir / f"rank{rank}.progress.jsonl"
        spec_path = self.dir / f"rank{rank}.json"
        replace(spec, rank=rank, local_rank=local_rank, local_world_size=local_world, progress_path=str(progress),
                parent_pid=os.getpid()).save(spec_path)
        log_path = work_dir / f"rank{rank}.log"
        with open(log_path, "ab") as out:
            out.write(f"=== incarnation {self.incarnation} rank {rank} {time.strftime('%H:%M:%S')} ===\n".encode())
            offset = out.tell()
            entry = os.environ.get(RANK_ENTRY_ENV)
            argv = [sys.executable, entry] if entry else [sys.executable, "-m", "megascale.executor.rank"]
            proc = subprocess.Popen(argv + [str(spec_path)], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL,
                                    env={**os.environ, **env, "RANK": str(rank), "LOCAL_RANK": str(local_rank),
                                         "WORLD_SIZE": str(spec.world_size), "LOCAL_WORLD_SIZE": str(local_world),
                                         "MEGASCALE_INCARNATION": str(self.incarnation)})
        log.info("incarnation %d: started rank %d (pid %d)", self.incarnation, rank, proc.pid)
        return RankProcess(rank, local_rank, proc, log_path, progress, log_offset=offset)

    def poll(self) -> bool:
        # Exit codes first: a rank seen exited here has had everything it wrote read in this same poll
        # (its traceback's error line goes out with the heartbeat that reports it failed).
        codes = [p.proc.poll() for p in self.procs]
        for p in self.procs:
            self._read_progress(p)
            self._scan_log(p)
        states = [p.state_at(code) for p, code in zip(self.procs, codes)]
        changed, self._states = states != self._states, states
        for p, state in zip(self.procs, states):
            if changed and state == "failed":
                log.warning("incarnation %d: rank %d exited with code %s", self.incarnation, p.rank, p.proc.poll())
        return changed

    def _read_progress(self, p: RankProcess) -> None:
        try:
            with open(p.progress_path, "rb") as f:
                f.seek(p.progress_offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        end = chunk.rfind(b"\n") + 1  # a half-written last line waits for the next poll
        p.progress_offset += end
        for line in chunk[:end].splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            p.running = True
            if "restored_step" in record:
                p.restored_step = record["restored_step"]
            if "waiting" in record:
                p.waiting = (record["waiting"], record["since"]) if record["waiting"] else None
                if not record["waiting"] and p.last:  # a wait that ended is progress: the hang clock restarts
                    p.last = {**p.last, "time": record["time"]}
            if record.get("state") == "done":  # every rank learns the last step, not only the reporter
                p.done = True
                if "step" in record:
                    p.last = {**p.last, "step": record["step"]}
            elif "step" in record:
                if "val_loss" in record:
                    p.validated = {"val_step": record["step"], "val_loss": record["val_loss"],
                                   "val_ppl": record.get("val_ppl")}
                p.last = {**record, **p.validated}  # a validation's results stay shown until the next one
                self.steps.append({**record, "rank": p.rank})

    def _scan_log(self, p: RankProcess) -> None:
        try:
            with open(p.log_path, "rb") as f:
                f.seek(p.log_offset)
                chunk = f.read(1 << 20)
        except FileNotFoundError:
            return
        end = chunk.rfind(b"\n") + 1
        p.log_offset += end if end or len(chunk) < 1 << 20 else len(chunk)
        for raw in chunk[:end].splitlines():
            line = raw.decode(errors="replace").rstrip()
            kind = classify(line)
            if kind:
                line = TORCH_PREFIX.sub("", line)
                self.errors.append(ErrorLine(rank=p.rank, kind=kind, line=line[:300], time=time.time()))  # type: ignore[arg-type]

    def statuses(self) -> list[RankStatus]:
        return [p.status() for p in self.procs]

    def newest(self) -> dict:
        """The newest step statistics of any local rank (the reporting rank, when it is here)."""
        lasts = [p.last for p in self.procs if p.last]
        return max(lasts, key=lambda s: (s["step"], "loss" in s)) if lasts else {}

    def restored_step(self) -> Optional[int]:
        """The step the local ranks started from (they restore the same one), once all reported it."""
        steps = [p.restored_step for p in self.procs]
        return None if None in steps else min(steps)  # type: ignore[type-var]

    def waiting(self) -> Optional[tuple[str, float]]:
        """What the longest-waiting live local rank is blocked on outside a step, and since when."""
        waits = [p.waiting for p in self.procs if p.waiting and p.proc.poll() is None]
        return min(waits, key=lambda w: w[1]) if waits else None

    def alive(self) -> bool:
        return any(p.proc.poll() is None for p in self.procs)

    def stop(self, grace_s: float = 5.0, tick: Optional[Callable[[], None]] = None) -> None:
        """SIGTERM (with SIGCONT, for a stopped rank), then SIGKILL after `grace_s` for a rank that
        outlives it (one with a SIGTERM handler, or in uninterruptible sleep).
        `tick` runs while waiting, so the node keeps heartbeating."""
        for p in self.procs:
            if p.proc.poll() is None:
                p.stopping = True
                p.proc.send_signal(signal.SIGTERM)
                p.proc.send_signal(signal.SIGCONT)  # a stopped (SIGSTOP, frozen) rank must run to die
        deadline = time.monotonic() + grace_s
        while any(p.proc.poll() is None for p in self.procs) and time.monotonic() < deadline:
            if tick:
                tick()
            time.sleep(0.05)
        for p in self.procs:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()
        self.poll()
