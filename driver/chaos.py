"""`megascale chaos JOB KIND --node N`: inject a fault into a running local job (tests, demos, bench).

Every injection is recorded in the job's Redis with its time, so the driver can measure detection
latency from the real moment of the fault. The kinds that signal processes by pid need the local
backend; `slow-rank` and `fail-selfcheck` go through Redis to the node's executor, `nan-loss` through a
file the reporting rank reads; `link-down` and `slow-link` change a node's link on an emulated network
(`cluster.network: emulated`, megascale/common/netemu.py).
"""
from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path
from typing import Optional

import psutil

from megascale.checkpoint.storage import CheckpointError, committed_steps, open_storage, read_manifest, step_dir
from megascale.common import netemu
from megascale.common.messages import SlowRank, encode, slow_ranks_key
from megascale.common.processes import pid_alive
from megascale.common.rankspec import RankSpec, nan_loss_order
from megascale.config import CheckpointConfig, from_dict

from .local import recorded_executor
from .state import JobState, JobStore

KINDS = ("kill-rank", "kill-node", "freeze-node", "hang", "slow-rank", "nan-loss", "fail-selfcheck", "crash-loop",
         "corrupt-checkpoint", "link-down", "slow-link", "slow")
ALIASES = {"slow": "fail-selfcheck"}  # its old name: it never slowed anything, it fails the next self-check
SLOW_SELFCHECK = {"MEGASCALE_DIAG_SLOW_GEMM": "1:0.2"}  # the node's second device computes at 0.2x
# kind -> (signal, sent to a "rank" or the node's executor, what was done)
KILLED_WITHIN_S = 5.0  # a process of many threads and much memory takes a while to be torn down after SIGKILL
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
    """The pid of `node`'s running executor, checked as the driver checks it (driver/local.py): whoever can
    write the job's Redis must not make `chaos` signal a process of theirs choosing."""
    raw = store.r.hget(f"megascale:{{{store.job}}}:local", node)
    if not raw:
        rec = store.load()
        slot = rec.slot(node) if rec else None
        raise ChaosError(f"node {node} of job {store.job} was evicted" if slot and slot.role == "evicted" else
                         f"job {store.job} has no local node {node!r}")
    proc = recorded_executor(store.job, node, raw, store.signer)
    if proc is None:
        raise ChaosError(f"node {node} is not running (evicted or stopped)")
    return proc.pid


def rank_procs(store: JobStore, node: str) -> list[psutil.Process]:
    """The node's rank processes (children of its executor that are a rank), by rank order."""
    try:
        children = psutil.Process(executor_pid(store, node)).children()
    except psutil.Error:
        raise ChaosError(f"node {node} is not running") from None
    ranks = [(found[0], child) for child in children if (found := rank_of(child)) is not None]
    return [p for _, p in sorted(ranks, key=lambda t: t[0])]


def standby_pids(store: JobStore, node: str) -> list[int]:
    """The node's warm standby processes (executor/standby.py) that are no rank yet."""
    try:
        children = psutil.Process(executor_pid(store, node)).children()
    except psutil.Error:
        raise ChaosError(f"node {node} is not running") from None
    found = []
    for child in children:
        try:
            if "--standby" in child.cmdline() and rank_of(child) is None:
                found.append(child.pid)
        except psutil.Error:
            continue
    return found


def rank_of(proc: psutil.Process) -> Optional[tuple[int, Path]]:
    """(rank, its node's work directory) of a rank process: one started for a rank names its first spec
    on its command line; a standby that became one (executor/standby.py) writes to the rank's log."""
    try:
        cmdline = proc.cmdline()
        spec = next((a for a in cmdline if a.endswith(".json") and "/incarnation-" in a), None)
        if spec:
            return int(Path(spec).stem[4:]), Path(spec).parent.parent
        if "--standby" in cmdline:
            out = Path(os.readlink(f"/proc/{proc.pid}/fd/1"))
            if out.name.startswith("rank") and out.name.endswith(".log") and out.name[4:-4].isdigit():
                return int(out.name[4:-4]), out.parent
    except (psutil.Error, OSError):
        pass
    return None


def pick_rank(store: JobStore, node: str, rank: Optional[int]) -> psutil.Process:
    for p in rank_procs(store, node):
        if rank is None or (rank_of(p) or (None,))[0] == rank:
            return p
    raise ChaosError(f"node {node} has no running rank{'' if rank is None else f' {rank}'}")


def inject(store: JobStore, kind: str, node: Optional[str] = None, rank: Optional[int] = None, count: int = 0,
           checkpoint: Optional[CheckpointConfig] = None, timeout_s: float = 300.0, factor: float = 2.0,
           duration_s: Optional[float] = None, gbit: Optional[float] = None) -> str:
    """Does it; returns one line saying what was done. `node` defaults to n0 (slow-rank: the rank's node)."""
    kind = ALIASES.get(kind, kind)
    if kind == "slow-rank":
        return _slow_rank(store, node, rank, factor, duration_s)
    if kind == "nan-loss":
        return _nan_loss(store)
    node = node or "n0"
    if kind in ("link-down", "slow-link"):
        return _link(store, kind, node, duration_s, gbit)
    if kind in SIGNALS:
        sig, target, done = SIGNALS[kind]
        pid = pick_rank(store, node, rank).pid if target == "rank" else executor_pid(store, node)
        store.record_chaos(kind, node, {"pid": pid})
        try:
            os.kill(pid, sig)
        except ProcessLookupError:  # it ended between the check and the signal
            raise ChaosError(f"node {node}: pid {pid} ended before {kind} reached it") from None
        if sig == signal.SIGKILL:  # "killed" once it is: a `resume` right after must not see it still alive
            deadline = time.monotonic() + KILLED_WITHIN_S
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.01)
        return done.format(pid=pid, node=node)
    if kind == "fail-selfcheck":
        store.set_injection(node, SLOW_SELFCHECK)
        return f"{node} fails its next self-check's GEMM test (needs MEGASCALE_DIAG_ALLOW_FAULTS=1 on the node)"
    if kind == "crash-loop":
        return _crash_loop(store, node, count, timeout_s)
    if kind == "corrupt-checkpoint":
        return _corrupt(checkpoint or CheckpointConfig())
    raise ChaosError(f"unknown chaos kind {kind!r} (known: {', '.join(KINDS)})")


def _slow_rank(store: JobStore, node: Optional[str], rank: Optional[int], factor: float,
               duration_s: Optional[float]) -> str:
    """Makes one rank's process `factor` times slower (its executor throttles it: executor/throttle.py) for
    `duration_s` seconds, or until the job ends; factor 1 ends it. Recorded like every injection."""
    rec = store.load()
    if rec is None:
        raise ChaosError(f"job {store.job} is not in its Redis")
    cfg = from_dict(rec.config)
    if rank is None or not 0 <= rank < cfg.parallelism.world_size:
        raise ChaosError(f"slow-rank: --rank must name one of the job's ranks 0..{cfg.parallelism.world_size - 1}")
    if not 1 <= factor < math.inf or duration_s is not None and not 0 < duration_s < math.inf:  # nan too
        raise ChaosError("slow-rank: --factor must be at least 1 (1 ends a slow-down) and --for above 0")
    slot = next((s for s in rec.slots("active") if s.index == rank // cfg.ranks_per_node), None)
    if slot is None:
        raise ChaosError(f"slow-rank: no active node holds rank {rank} now")
    if node is not None and node != slot.node:
        raise ChaosError(f"slow-rank: rank {rank} runs on {slot.node}, not {node}")
    key = slow_ranks_key(store.job, slot.node)
    if factor == 1:
        store.r.hdel(key, str(rank))
        return f"rank {rank} on {slot.node} runs at full speed again"
    until = time.time() + duration_s if duration_s else None
    store.r.hset(key, str(rank), encode(SlowRank(job=store.job, node=slot.node, rank=rank, factor=factor,
                                                 until=until)))
    store.record_chaos("slow-rank", slot.node, {"rank": rank, "factor": factor, "for_s": duration_s})
    how_long = f"for {duration_s:g} s" if duration_s else "until the job ends (--factor 1 ends it)"
    return f"rank {rank} on {slot.node} computes {factor:g}x slower {how_long}"


def _nan_loss(store: JobStore) -> str:
    """The reporting rank's next step report carries a NaN loss, once (megascale/common/rankspec.py reads the
    order): the driver's nan_loss path end to end. The training state itself stays finite."""
    rec = store.load()
    if rec is None:
        raise ChaosError(f"job {store.job} is not in its Redis")
    cfg = from_dict(rec.config)
    p = cfg.parallelism
    rank = p.tp * p.dp * (p.pp - 1)  # tp 0, dp 0 of the last stage (rank order: tp, then dp, then pp)
    slot = next((s for s in rec.slots("active") if s.index == rank // cfg.ranks_per_node), None)
    if slot is None:
        raise ChaosError(f"nan-loss: no active node holds the reporting rank {rank} now")
    # The current incarnation's spec is in the rank's node's work directory (an in-process restart keeps the
    # process, whose command line names its first one).
    found = rank_of(pick_rank(store, slot.node, rank))
    if found is None:
        raise ChaosError(f"nan-loss: rank {rank} on {slot.node} is not running")
    spec = found[1] / f"incarnation-{rec.incarnation}" / f"rank{rank}.json"
    try:
        progress = RankSpec.load(spec).progress_path
    except OSError:
        raise ChaosError(f"nan-loss: rank {rank} on {slot.node} has no spec for incarnation {rec.incarnation} "
                         f"yet") from None
    store.record_chaos("nan-loss", slot.node, {"rank": rank})
    nan_loss_order(progress).touch()
    return f"rank {rank} on {slot.node} reports a NaN loss at its next step"


def _link(store: JobStore, kind: str, node: str, duration_s: Optional[float], gbit: Optional[float]) -> str:
    """link-down: the node's data link is cut (its veth down) for `duration_s` seconds — this call waits and
    restores it — or until the job ends; its control link stays, so the node heartbeats on while its ranks'
    collectives time out, and the self-check finds the link; slow-link: its data link's rate becomes `gbit`."""
    rec = store.load()
    if rec is None or from_dict(rec.config).cluster.network != "emulated":
        raise ChaosError(f"{kind}: job {store.job} does not run on an emulated network (cluster.network)")
    net = netemu.JobNetwork(store.job)
    if net.namespace(node) not in netemu.leftovers(store.job):
        raise ChaosError(f"{kind}: job {store.job} has no node {node!r} on its network now")
    try:
        if kind == "slow-link":
            if gbit is None or not 0 < gbit < math.inf:
                raise ChaosError("slow-link: --gbit must be above 0")
            store.record_chaos(kind, node, {"gbit": gbit})
            netemu.set_rate(net, node, gbit)
            return f"{node}'s link runs at {gbit:g} Gbit/s each way"
        if duration_s is not None and not 0 < duration_s < math.inf:
            raise ChaosError("link-down: --for must be above 0")
        store.record_chaos(kind, node, {"for_s": duration_s})
        netemu.set_link(net, node, up=False)
        if duration_s is None:
            return f"{node}'s link is down until the job ends"
        time.sleep(duration_s)
        netemu.set_link(net, node, up=True)
        return f"{node}'s link was down for {duration_s:g} s and is up again"
    except netemu.NetworkError as e:  # the node evicted meanwhile (its namespace gone), or no root
        raise ChaosError(f"{kind}: {e}") from None


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
        storage = open_storage(checkpoint.uri, checkpoint.filesystem, checkpoint.filesystem_options)
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
