"""One node's ranks for one job incarnation: spawn, watch, tail their logs for errors, stop.

Each rank writes one log (stdout and stderr) and a progress file of JSON lines (`rank.py`):
`{"state": "running"}` once its process group is up, one line of step statistics per step on
the reporting rank, `{"state": "done"}` at the end. Files, not pipes, so a slow executor never
blocks a rank and the record survives for `megascale logs`.

With control.restart: in_process a rank process outlives its incarnation (rank.py): `leave` orders
the live ranks out of theirs, and the next group takes over the processes that said so (`left`, or
`failed` under them) and spawns only the missing ranks.
"""
from __future__ import annotations

import collections
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Callable, Optional

from megascale.common.jsonl import LineFollower
from megascale.common.messages import ErrorLine, RankState, RankStatus

from . import log
from .allocator import rank_allocator_env
from megascale.common.rankspec import STACKS_SIGNAL, RankSpec
from .standby import Standbys

# Set to a script path to run it instead of the training entry point (tests: fake ranks).
RANK_ENTRY_ENV = "MEGASCALE_RANK_ENTRY"
RECENT_ERRORS = 10
STACKS_WAIT_S = 0.3  # for a rank's stacks (STACKS_SIGNAL) to reach its log before it is stopped

# NVIDIA Xid codes that mean the GPU or its memory failed, not the program: 48 double-bit ECC, 61/62 internal
# micro-controller, 63/64 page retirement / row remapping, 74 NVLink, 79 fallen off the bus, 92 high single-bit
# ECC rate, 94/95 contained/uncontained ECC, 119/120 GSP, 140 unrecovered ECC. (13, 31, 43, 45: a program's fault.)
HARDWARE_XIDS = (48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140)

# First match wins: the specific patterns before the generic exception line. `hardware_error` is evidence of
# a bad machine (the driver evicts its node without a self-check; on Kubernetes its machine is cordoned), so
# it matches only what a program cannot cause; a failed ibv_ call (NCCL WARN) stays `comm_error`: the pod's
# configuration (memlock, no RDMA device allocated) or the far end fail those as often as a local NIC.
ERROR_PATTERNS: list[tuple[str, re.Pattern]] = [
    ("hardware_error", re.compile(r"NVRM: Xid \([^)]*\): (%s)\b|GPU has fallen off the bus|uncorrectable ECC error|"
                                  r"ECC page retirement|row remapping failure" % "|".join(map(str, HARDWARE_XIDS)),
                                  re.I)),
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
    progress_lines: LineFollower = field(default_factory=LineFollower)  # its progress file's, across rollovers
    running: bool = False  # its process group is up
    done: bool = False
    last: dict = field(default_factory=dict)  # newest step statistics
    validated: dict = field(default_factory=dict)  # val_step, val_loss, val_ppl of its newest validation
    restored_step: Optional[int] = None  # the step it started from, once known
    waiting: Optional[tuple[str, float]] = None  # (what, since when) it is blocked on outside a step
    out: Optional[str] = None  # "left" or "failed": out of its incarnation, its process waiting for the next

    def state(self) -> RankState:
        return self.state_at(self.proc.poll())

    def state_at(self, code: Optional[int]) -> RankState:
        """Its state given its exit code as polled (None: still running)."""
        if code is None and self.out:
            return "failed" if self.out == "failed" else "stopped"
        if code is None:
            return "running" if self.running else "starting"
        if code == 0 and self.done:
            return "succeeded"
        return "stopped" if self.stopping else "failed"

    def status(self) -> RankStatus:
        return RankStatus(rank=self.rank, local_rank=self.local_rank, state=self.state(), pid=self.proc.pid,
                          exit_code=self.proc.poll(), step=self.last.get("step"),
                          step_time=self.last.get("step_time"), loss=self.last.get("loss"))


def _finite(loss) -> bool:
    return not isinstance(loss, float) or math.isfinite(loss)


class RankGroup:
    """The ranks one `start` command asked for. `poll()` reports whether anything a heartbeat shows changed."""

    def __init__(self, work_dir: Path, spec: RankSpec, ranks: list[int], env: dict[str, str],
                 kept: Optional[dict[int, RankProcess]] = None, standbys: Optional[Standbys] = None):
        """`kept`: processes of the previous incarnation waiting for this one, by rank (in-process restart);
        `standbys`: warm processes to take the other ranks' places before new ones are started."""
        self.incarnation = incarnation = spec.incarnation
        self.in_process = restarts_in_process(spec.config)
        self.dir = work_dir / f"incarnation-{incarnation}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.errors: collections.deque[ErrorLine] = collections.deque(maxlen=RECENT_ERRORS)
        self.steps: list[dict] = []  # step lines not yet published as metrics
        # The first non-finite loss since the last heartbeat: a heartbeat shows only the newest step, and one
        # NaN step between two heartbeats must not go unseen by the driver's nan_loss detector.
        self.nonfinite: Optional[dict] = None
        # The incarnation's first step, until a heartbeat carries it: the driver times the restart by it.
        self.first_step_news = False
        self._stepped = False
        self.procs: list[RankProcess] = []
        for local_rank, rank in enumerate(ranks):
            spec_path, progress = self._write_spec(spec, rank, local_rank, len(ranks))
            log_path = work_dir / f"rank{rank}.log"
            with open(log_path, "ab") as out:
                out.write(f"=== incarnation {incarnation} rank {rank} {time.strftime('%H:%M:%S')} ===\n".encode())
                out.flush()
                offset = out.tell()
                if kept and rank in kept:
                    proc = kept[rank].proc
                    order(proc, {"op": "join", "spec": str(spec_path)})
                    log.info("incarnation %d: rank %d joins in its process (pid %d)", incarnation, rank, proc.pid)
                elif standbys is not None and not os.environ.get(RANK_ENTRY_ENV) \
                        and (proc := standbys.take()) is not None:  # type: ignore[assignment]
                    order(proc, {"op": "join", "spec": str(spec_path), "log": str(log_path),
                                 "env": {**env, **self._rank_env(rank, local_rank, len(ranks), spec.world_size)}})
                    log.info("incarnation %d: rank %d starts in a standby process (pid %d)", incarnation, rank,
                             proc.pid)
                else:
                    proc = self._spawn(spec_path, out, rank, local_rank, len(ranks), spec.world_size, env)
            self.procs.append(RankProcess(rank, local_rank, proc, log_path, progress, log_offset=offset))
        self._states = [p.state() for p in self.procs]

    def _write_spec(self, spec: RankSpec, rank: int, local_rank: int, local_world: int) -> tuple[Path, Path]:
        progress = self.dir / f"rank{rank}.progress.jsonl"
        spec_path = self.dir / f"rank{rank}.json"
        replace(spec, rank=rank, local_rank=local_rank, local_world_size=local_world, progress_path=str(progress),
                parent_pid=os.getpid()).save(spec_path)
        return spec_path, progress

    def _spawn(self, spec_path: Path, out: IO[bytes], rank: int, local_rank: int, local_world: int, world_size: int,
               env: dict[str, str]) -> subprocess.Popen:
        entry = os.environ.get(RANK_ENTRY_ENV)
        argv = [sys.executable, entry] if entry else [sys.executable, "-m", "megascale.executor.rank"]
        proc = subprocess.Popen(argv + [str(spec_path)], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.PIPE if self.in_process else subprocess.DEVNULL,
                                env={**os.environ, **rank_allocator_env(), **env,
                                     **self._rank_env(rank, local_rank, local_world, world_size)})
        if proc.stdin is not None:
            os.set_blocking(proc.stdin.fileno(), False)  # a rank that stopped reading never blocks the executor
        log.info("incarnation %d: started rank %d (pid %d)", self.incarnation, rank, proc.pid)
        return proc

    def _rank_env(self, rank: int, local_rank: int, local_world: int, world_size: int) -> dict[str, str]:
        return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(local_world), "MEGASCALE_INCARNATION": str(self.incarnation)}

    def poll(self) -> bool:
        # Exit codes first: a rank seen exited here has had everything it wrote read in this same poll
        # (its traceback's error line goes out with the heartbeat that reports it failed).
        codes = [p.proc.poll() for p in self.procs]
        for p in self.procs:
            self._read_progress(p)
            self._scan_log(p)
        states = [p.state_at(code) for p, code in zip(self.procs, codes)]
        changed, self._states = states != self._states, states
        for p, state, code in zip(self.procs, states, codes):
            if changed and state == "failed":
                log.warning("incarnation %d: rank %d %s", self.incarnation, p.rank,
                            f"exited with code {code}" if code is not None else "failed; its process waits")
        return changed

    def _read_progress(self, p: RankProcess) -> None:
        for line in p.progress_lines.read(p.progress_path):
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
            if record.get("state") in ("left", "failed"):
                p.out = record["state"]
            elif record.get("state") == "done":  # every rank learns the last step, not only the reporter
                p.done = True
                if "step" in record:
                    p.last = {**p.last, "step": record["step"]}
            elif "step" in record:
                if "val_loss" in record:
                    p.validated = {"val_step": record["step"], "val_loss": record["val_loss"],
                                   "val_ppl": record.get("val_ppl")}
                p.last = {**record, **p.validated}  # a validation's results stay shown until the next one
                if not self._stepped:
                    self._stepped = self.first_step_news = True
                self.steps.append({**record, "rank": p.rank})
                if self.nonfinite is None and not _finite(record.get("loss")):
                    self.nonfinite = {"step": record["step"], "loss": record["loss"]}

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

    def take_nonfinite(self) -> Optional[dict]:
        """The first step with a non-finite loss since the last call (its step and loss), or None."""
        found, self.nonfinite = self.nonfinite, None
        return found

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

    def training(self) -> bool:
        """Whether a rank process is still in this incarnation (alive, and not out of it)."""
        return any(p.proc.poll() is None and not p.out for p in self.procs)

    def leave(self, timeout_s: float, grace_s: float, tick: Optional[Callable[[], None]] = None) -> int:
        """In-process restart: orders every rank still in the incarnation out of it, and stops (`stop`) those
        not out within `timeout_s`: blocked where no abort reaches, or stopped (SIGSTOP: those are stopped
        at once, a stopped process reads no orders). Returns how many processes wait for the next one."""
        for p in self.procs:
            if p.proc.poll() is None and not p.out:
                order(p.proc, {"op": "leave"})
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.poll()
            inside = [p for p in self.procs if p.proc.poll() is None and not p.out]
            if not inside or all(stopped(p.proc.pid) for p in inside):
                break
            if tick:
                tick()
            time.sleep(0.05)
        stuck = [p for p in self.procs if p.proc.poll() is None and not p.out and not stopped(p.proc.pid)]
        for p in stuck:
            log.warning("incarnation %d: rank %d (pid %d) did not leave within %g s of the order: stopping it; "
                        "its threads' stacks are in its log", self.incarnation, p.rank, p.proc.pid, timeout_s)
            p.proc.send_signal(STACKS_SIGNAL)
        if stuck:
            time.sleep(STACKS_WAIT_S)
        self.stop(grace_s, tick, only=[p for p in self.procs if not p.out])
        return len(self.waiting_for_next())

    def waiting_for_next(self) -> dict[int, RankProcess]:
        """The rank processes out of this incarnation and waiting for the next, by rank."""
        return {p.rank: p for p in self.procs if p.out and p.proc.poll() is None}

    def stop(self, grace_s: float = 5.0, tick: Optional[Callable[[], None]] = None,
             only: Optional[list[RankProcess]] = None) -> None:
        """SIGTERM (with SIGCONT, for a stopped rank), then SIGKILL after `grace_s` for a rank that
        outlives it (one with a SIGTERM handler, or in uninterruptible sleep). `only`: these ranks, not all.
        `tick` runs while waiting, so the node keeps heartbeating."""
        procs = self.procs if only is None else only
        for p in procs:
            if p.proc.poll() is None:
                p.stopping = True
                p.proc.send_signal(signal.SIGTERM)
                p.proc.send_signal(signal.SIGCONT)  # a stopped (SIGSTOP, frozen) rank must run to die
        deadline = time.monotonic() + grace_s
        while any(p.proc.poll() is None for p in procs) and time.monotonic() < deadline:
            if tick:
                tick()
            time.sleep(0.05)
        for p in procs:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()
        self.poll()


def restarts_in_process(config: dict) -> bool:
    """control.restart: in_process, for ranks that can (the training entry point, not a test's stand-in)."""
    return config.get("control", {}).get("restart", "in_process") == "in_process" and not os.environ.get(RANK_ENTRY_ENV)


def order(proc: subprocess.Popen, message: dict) -> None:
    """Writes one order to a rank's stdin (rank.py); a rank that exited meanwhile has nothing to obey."""
    try:  # one write of a line shorter than PIPE_BUF: whole or not at all, never buffered half-way
        os.write(proc.stdin.fileno(), json.dumps(message).encode() + b"\n")  # type: ignore[union-attr]
    except (BrokenPipeError, BlockingIOError):  # gone, or so far behind that the stop that follows is the answer
        pass


def stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, or a throttle's pause): it cannot read an order now."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return False
