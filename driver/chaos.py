"""`megascale chaos JOB KIND --node N`: inject a fault into a running local job (tests, demos, bench).

Every injection is recorded in the job's Redis with its time, so the driver can measure detection
latency from the real moment of the fault. Local backend only: it signals processes by pid.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Optional

import psutil

from megascale.checkpoint.storage import CheckpointError, committed_steps, open_storage, read_manifest, step_dir
from megascale.config import CheckpointConfig

from .state import JobState, JobStore

KINDS = ("kill-rank", "kill-node", "freeze-node", "hang", "slow", "crash-loop", "corrupt-checkpoint")
SLOW_SELFCHECK = {"MEGASCALE_DIAG_SLOW_GEMM": "1:0.2"}  # the node's second device computes at 0.2x
# kind -> (signal, sent to a "rank" or the node's executor, what was done)
SIGNALS = {
    "kill-rank": (signal.SIGKILL, "rank", "killed rank process {pid} on {node}"),
    # The node's ranks die with their executor (PR_SET_PDEATHSIG), its checkpoint keeper too.
    "kill-node": (signal.SIGKILL, "executor", "killed executor {pid} of {node}"),
    # Heartbeats stop while the ranks train on: a node cut off from the control plane.
    "freeze-node": (signal.SIGSTOP, "executor", "froze executor {pid} of {node} (SIGSTOP): its heartbeats stop, "
                                                "its ranks run on"),
    "hang": (signal.SIGSTOP, "rank", "stopped (SIGSTOP) rank process {pid} on {node}"),
}


class ChaosError(Exception):
    """One line for the user."""


def executor_pid(store: JobStore, node: str) -> int:
    raw = store.r.hget(f"megascale:{{{store.job}}}:local", node)
    if not raw:
        raise ChaosError(f"job {store.job} has no local node {node!r}")
    return json.loads(raw)["pid"]


def rank_procs(store: JobStore, node: str) -> list[psutil.Process]:
    """The node's rank processes (children of its executor running a rank spec), by rank order."""
    try:
        children = psutil.Process(executor_pid(store, node)).children()
    except psutil.Error:
        raise ChaosError(f"node {node} is not running") from None
    ranks = []
    for child in children:
        try:
            spec = next((a for a in child.cmdline() if a.endswith(".json") and "/incarnation-" in a), None)
        except psutil.Error:
            continue
        if spec:
            ranks.append((int(Path(spec).stem[4:]), child))
    return [p for _, p in sorted(ranks, key=lambda t: t[0])]


def pick_rank(store: JobStore, node: str, rank: Optional[int]) -> psutil.Process:
    procs = rank_procs(store, node)
    for p in procs:
        if rank is None or f"rank{rank}.json" in " ".join(p.cmdline()):
            return p
    raise ChaosError(f"node {node} has no running rank{'' if rank is None else f' {rank}'}")


def inject(store: JobStore, kind: str, node: str, rank: Optional[int] = None, count: int = 0,
           checkpoint: Optional[CheckpointConfig] = None, timeout_s: float = 300.0) -> str:
    """Does it; returns one line saying what was done."""
    if kind in SIGNALS:
        sig, target, done = SIGNALS[kind]
        pid = pick_rank(store, node, rank).pid if target == "rank" else executor_pid(store, node)
        store.record_chaos(kind, node, {"pid": pid})
        os.kill(pid, sig)
        return done.format(pid=pid, node=node)
    if kind == "slow":
        store.set_injection(node, SLOW_SELFCHECK)
        return f"{node} fails its next self-check's GEMM test (needs MEGASCALE_DIAG_ALLOW_FAULTS=1 on the node)"
    if kind == "crash-loop":
        return _crash_loop(store, node, count, timeout_s)
    if kind == "corrupt-checkpoint":
        return _corrupt(checkpoint or CheckpointConfig())
    raise ChaosError(f"unknown chaos kind {kind!r} (known: {', '.join(KINDS)})")


def _crash_loop(store: JobStore, node: str, count: int, timeout_s: float) -> str:
    """Kills a rank of every new incarnation once it runs, until the job ends or `count` kills."""
    killed, seen, deadline = 0, 0, time.monotonic() + timeout_s
    while time.monotonic() < deadline and (count <= 0 or killed < count):
        rec = store.load()
        if rec is None or rec.terminal:
            break
        if rec.state == JobState.RUNNING and rec.incarnation > seen:
            try:
                inject(store, "kill-rank", node)
                killed, seen = killed + 1, rec.incarnation
            except ChaosError:
                pass
        time.sleep(0.2)
    rec = store.load()
    return f"crash loop on {node}: {killed} rank(s) killed; job {rec.state.value if rec else 'gone'}"


def _corrupt(checkpoint: CheckpointConfig) -> str:
    """Flips bytes all through every shard of the newest committed checkpoint: a restore must see
    the checksums fail and fall back to the checkpoint before it (host snapshots, which verify
    against the manifest, are not touched)."""
    if not checkpoint.uri:
        raise ChaosError("corrupt-checkpoint: the job has no checkpoint.uri")
    try:
        storage = open_storage(checkpoint.uri, checkpoint.filesystem)
        steps = committed_steps(storage)
        if not steps:
            raise ChaosError(f"corrupt-checkpoint: no committed checkpoint under {checkpoint.uri} yet")
        step = max(steps)
        paths = [storage.path(step_dir(step), entry["file"])
                 for entry in read_manifest(storage, step)["shards"].values()]
        for path in paths:
            with storage.fs.open_input_stream(path) as f:
                data = bytearray(f.read())
            for i in range(0, len(data), max(1, len(data) // 64)):
                data[i] ^= 0xFF
            with storage.fs.open_output_stream(path) as f:
                f.write(bytes(data))
    except (CheckpointError, OSError) as e:
        raise ChaosError(f"corrupt-checkpoint: {e}") from None
    return f"corrupted {len(paths)} shard(s) of checkpoint step {step} under {checkpoint.uri}"
