"""The job state machine and its durable record in Redis.

    Pending ─▶ Initializing ─▶ Running ─▶ Succeeded
       │            │  ▲          │
       │            ▼  │          ▼
       │         Recovering ◀─────┤        any non-terminal ─▶ Stopped (user) | Failed
       │            │             ▼
       └──────────▶ Paused ◀──────┘

The driver is the only writer of the record (it holds a lease); the CLI writes only the
*desired* state (running / paused / stopped) and eviction requests, which the driver reads
on every pass. So a killed driver loses nothing: the next one loads the record, finds the
commands it was waiting on, and carries on.
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal, Optional

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from megascale.common import auth, typed
from megascale.common.messages import (Ack, Command, MessageError, acks_key, command_stream, decode, encode,
                                       selfchecks_key, training_key)

from .recovery_record import BackgroundCheck, Recovery, Timeline


class JobState(str, Enum):
    PENDING = "Pending"  # nodes being started
    INITIALIZING = "Initializing"  # ranks of a new incarnation being started
    RUNNING = "Running"
    PAUSED = "Paused"  # ranks stopped; waits for `resume`
    RECOVERING = "Recovering"  # a fault: ranks being stopped, then the recovery policy decides
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    STOPPED = "Stopped"  # by the user (`megascale stop`)


TERMINAL = {JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED}
RECONNECT_TRIES = 15  # ~12 s of backoff (0.1, 0.2, 0.4, 0.8, then 1 s each)
# Evicted nodes whose slots the record keeps (the newest; older ones are only counted): the record is rewritten
# every pass, and faults over weeks evict hundreds. At least what a status lists (the operator's 32).
EVICTED_KEPT = 64

TRANSITIONS: dict[JobState, set[JobState]] = {
    JobState.PENDING: {JobState.INITIALIZING, JobState.PAUSED},
    JobState.INITIALIZING: {JobState.RUNNING, JobState.RECOVERING, JobState.PAUSED},
    JobState.RUNNING: {JobState.SUCCEEDED, JobState.RECOVERING, JobState.PAUSED},
    JobState.PAUSED: {JobState.INITIALIZING, JobState.PAUSED},
    JobState.RECOVERING: {JobState.INITIALIZING, JobState.PAUSED},
    JobState.SUCCEEDED: set(), JobState.FAILED: set(), JobState.STOPPED: set(),
}
for _s in set(JobState) - TERMINAL:  # any live job can fail or be stopped
    TRANSITIONS[_s] |= {JobState.FAILED, JobState.STOPPED}

Desired = Literal["running", "paused", "stopped"]
Role = Literal["active", "spare", "evicted"]


class TransitionError(RuntimeError):
    """A bug in the driver: it tried a transition the state machine does not have."""


class Phase(str, Enum):
    """The command the current state waits on; its value is the op sent to every active node."""
    IDLE = ""  # nothing sent in this state yet
    START = "start"  # Initializing: the ranks of a new incarnation
    LOCALIZE = "flight"  # Recovering from a hang: every rank's flight recorder
    STOP = "stop"  # Recovering, Paused: every rank of the incarnation
    SELFCHECK = "diagnose"  # Recovering: the suspects and their group peers


@dataclass
class NodeSlot:
    node: str
    role: Role
    index: Optional[int] = None  # position among active nodes: ranks index*rpn .. (index+1)*rpn-1
    started: bool = False  # the backend was asked to start it (never twice: a dead node stays dead)
    dead: str = ""  # why the driver declared it dead, if it did


@dataclass
class JobRecord:
    job: str
    config: dict
    run_dir: str
    state: JobState = JobState.PENDING
    reason: str = ""
    entered: float = field(default_factory=time.time)  # when `state` was entered
    incarnation: int = 0  # rendezvous generation of the ranks; +1 per (re)start
    restarts: int = 0
    nodes: list[NodeSlot] = field(default_factory=list)
    next_node: int = 0  # node ids n0, n1, ... are never reused
    phase: Phase = Phase.IDLE  # the command this state waits on, and its seq per node
    waiting: dict[str, int] = field(default_factory=dict)
    waiting_since: float = 0.0
    recovery: Optional[Recovery] = None  # the newest fault and its handling
    cleaned: bool = False  # terminal state's nodes have been stopped
    created: float = field(default_factory=time.time)
    recoveries: list[dict] = field(default_factory=list)  # the newest finished ones' MTTR phases (timings.KEPT)
    recovered: int = 0  # recoveries finished, ever: each one's `n` in `recoveries`
    recovery_s: float = 0.0  # their total_s summed (MTTR)
    # ETTR: seconds that trained steps past the furthest one reached, that step, and the last step seen:
    # (incarnation, step, when its node saw it)
    productive_s: float = 0.0
    furthest_step: int = 0
    last_seen_step: Optional[tuple[int, int, float]] = None
    dp: Optional[int] = None  # the dp the ranks run at when shrunk (control.no_spare); None: parallelism.dp
    checking: dict[str, BackgroundCheck] = field(default_factory=dict)  # node -> its self-check in the background
    evicted_forgotten: int = 0  # evicted nodes whose slots were dropped (EVICTED_KEPT)

    def move(self, state: JobState, reason: str = "") -> JobState:
        """Enters `state`; returns the previous one. Refuses transitions the machine does not have."""
        if state not in TRANSITIONS[self.state]:
            raise TransitionError(f"{self.state.value} -> {state.value} is not a transition")
        previous, self.state, self.reason, self.entered = self.state, state, reason, time.time()
        self.phase, self.waiting, self.waiting_since = Phase.IDLE, {}, 0.0
        return previous

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def slots(self, role: Role) -> list[NodeSlot]:
        found = [s for s in self.nodes if s.role == role]
        return sorted(found, key=lambda s: s.index) if role == "active" else found

    def shown_slots(self, evicted_kept: int) -> list[NodeSlot]:
        """The nodes a status lists: those in service and the last `evicted_kept` evicted ones (by node id). Faults
        over weeks evict hundreds, and a status is rewritten every pass; the latest are what an operator looks at."""
        evicted = [slot.node for slot in self.slots("evicted")]
        newest = set(evicted[-evicted_kept:]) if evicted_kept else set()
        return [slot for slot in self.nodes if slot.role != "evicted" or slot.node in newest]

    @property
    def evicted(self) -> int:
        """Nodes evicted, ever."""
        return self.evicted_forgotten + len(self.slots("evicted"))

    def forget_old_evicted(self, kept: int = EVICTED_KEPT) -> list[str]:
        """Drops the slots of all but the newest `kept` evicted nodes (by node id), counting them, and returns
        their ids. The ids stay unused (`next_node`), and heartbeats naming them are dropped as from no node of
        the job."""
        evicted = self.slots("evicted")
        forgotten = evicted[:max(0, len(evicted) - kept)]
        for slot in forgotten:
            self.nodes.remove(slot)
        self.evicted_forgotten += len(forgotten)
        return [slot.node for slot in forgotten]

    def slot(self, node: str) -> Optional[NodeSlot]:
        return next((s for s in self.nodes if s.node == node), None)

    def node_names(self) -> frozenset[str]:
        return frozenset(s.node for s in self.nodes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), default=lambda o: o.value)

    @classmethod
    def from_json(cls, raw: bytes | str) -> "JobRecord":
        data = json.loads(raw)
        if "waiting_op" in data:
            _upgrade(data)
        return typed.read(cls, data)


def _upgrade(data: dict) -> None:
    """A record written before the typed recovery record (a `waiting_op` string; `fault` and `recovery` dicts),
    in today's form, so a job outlives an upgrade of its driver."""
    data["phase"] = data.pop("waiting_op")
    fault, clock = data.pop("fault"), data.pop("recovery")
    checks = {k: data.pop(k) for k in ("suspects", "bad", "rechecked")}
    timeline = {f.name: clock[f.name] for f in dataclasses.fields(Timeline) if f.name in clock} if clock else None
    data["recovery"] = {"fault": fault, "timeline": timeline, **checks} if fault else None


@dataclass
class NodeStatus:
    node: str
    role: Role
    alive: bool
    dead: str = ""
    host: str = ""
    phase: str = ""
    last_heartbeat: Optional[float] = None  # epoch seconds when the driver received it
    ranks: dict[str, int] = field(default_factory=dict)  # rank state -> count, current incarnation
    step: Optional[int] = None
    errors: list[str] = field(default_factory=list)
    waiting: str = ""  # what its ranks are blocked on outside a step, and for how long


@dataclass
class JobStatus:
    """What `status` and `run` show: the driver's view, rewritten every pass."""
    job: str
    state: str
    reason: str = ""
    incarnation: int = 0
    restarts: int = 0
    total_steps: Optional[int] = None
    step: Optional[int] = None
    loss: Optional[float] = None
    tokens_per_s: Optional[float] = None
    val_step: Optional[int] = None  # the newest validation (eval.every): its step, loss and perplexity
    val_loss: Optional[float] = None
    val_ppl: Optional[float] = None
    nodes: list[NodeStatus] = field(default_factory=list)
    driver: str = ""
    updated: float = 0.0
    heartbeats: int = 0  # heartbeats ingested by this driver
    ignored: int = 0  # heartbeat records it dropped: malformed, foreign, forged, replayed
    rejected: dict[str, int] = field(default_factory=dict)  # the same by reason (a few fixed reasons)
    ettr: Optional[float] = None  # effective training time ratio, 0-1
    mttr_s: Optional[float] = None  # mean time to recovery over finished recoveries
    recoveries: list[dict] = field(default_factory=list)  # the newest (timings.KEPT), numbered by `n`
    recovered: int = 0  # finished recoveries, ever
    evicted: int = 0  # nodes evicted, ever (`nodes` lists the newest EVICTED_SHOWN of them)
    stragglers: list[str] = field(default_factory=list)  # one line per straggler finding (straggler_report.describe)
    prometheus: Optional[str] = None  # the driver's /metrics URL; None when control.prometheus_port is -1
    timings_stored: int = 0  # step-timing rows the driver wrote to <run_dir>/metrics

    @classmethod
    def from_dict(cls, data: dict) -> "JobStatus":
        return typed.read(cls, data)


def status_view(status: Optional[JobStatus], rec: Optional[JobRecord]) -> dict:
    """The status to show, as plain data, with the record's state and reason (a pass newer, maybe)."""
    shown = dataclasses.asdict(status) if status else {}
    return {**shown, "state": rec.state.value, "reason": rec.reason, "restarts": rec.restarts} if rec else shown


class JobStore:
    """All of one job's control-plane keys in Redis (hash tag {job}: one Cluster slot)."""

    def __init__(self, client: redis.Redis, job: str, signer: Optional[auth.Signer] = None):
        self.r, self.job = client, job
        self.signer = signer  # of the job's records that this store cannot vouch for (driver/local.py), if keyed
        ns = f"megascale:{{{job}}}:"
        self.k_record, self.k_desired, self.k_evict = ns + "record", ns + "desired", ns + "evict"
        self.k_status, self.k_lease, self.k_offsets = ns + "status", ns + "driver", ns + "offsets"
        self.k_seq = ns + "cmdseq"
        self.k_chaos, self.k_inject, self.k_spares = ns + "chaos", ns + "inject", ns + "spares"
        self.k_training = training_key(job)
        self._stored: Optional[bytes] = None  # the record as Redis held it when last read or written here

    @classmethod
    def from_url(cls, url: str, job: str, timeout_s: float = 5.0,
                 secrets: Optional[auth.JobSecrets] = None) -> "JobStore":
        """Logged in with `secrets`, else those of $MEGASCALE_SECRETS, unless the URL carries credentials."""
        # Reconnects through a restart of the server (the supervisor brings an embedded one back within ~1 s).
        reconnect = Retry(ExponentialBackoff(cap=1.0, base=0.05), RECONNECT_TRIES)
        found = secrets or auth.from_env()
        return cls(redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                        retry=reconnect, **auth.redis_auth(url, secrets)), job,
                   found.signer() if found else None)

    # -- record (driver-owned) ---------------------------------------------------------------

    def load(self) -> Optional[JobRecord]:
        raw = self.r.get(self.k_record)
        self._stored = raw
        return JobRecord.from_json(raw) if raw else None

    def save(self, record: JobRecord) -> None:
        """Writes the record unless Redis holds these bytes already (as last read or written here): most of the
        driver's passes change nothing, and every write goes to the embedded Redis's append-only file (85% of them
        were the same bytes again). The driver reads the record every pass, so a write that a restarted Redis
        lost is compared with what it holds now and made again."""
        raw = record.to_json().encode()
        if raw != self._stored:
            self.r.set(self.k_record, raw)
            self._stored = raw

    def submit(self, record: JobRecord) -> tuple[JobRecord, bool]:
        """Stores a new job unless a live one of this name exists; returns (the job's record, is_new)."""
        existing = self.load()
        if existing and not existing.terminal:
            return existing, False
        pipe = self.r.pipeline()
        pipe.delete(self.k_desired, self.k_evict, self.k_spares, self.k_status, self.k_offsets, self.k_chaos,
                    self.k_inject, self.k_training)
        pipe.set(self.k_record, record.to_json())
        pipe.execute()
        self._stored = None
        return record, True

    # -- requests (CLI-owned) ----------------------------------------------------------------

    def desired(self) -> Desired:
        raw = self.r.get(self.k_desired)
        return raw.decode() if raw else "running"  # type: ignore[return-value]

    def set_desired(self, desired: Desired) -> None:
        self.r.set(self.k_desired, desired)

    def request_evict(self, node: str) -> None:
        self.r.sadd(self.k_evict, node)

    def evict_requests(self) -> list[str]:
        return sorted(m.decode() for m in self.r.smembers(self.k_evict))

    def done_evict(self, node: str) -> None:
        self.r.srem(self.k_evict, node)

    def set_spares(self, count: int) -> None:
        self.r.set(self.k_spares, count)

    def spares(self) -> Optional[int]:
        """The hot-spare count a user set with `megascale spares`, overriding cluster.spares."""
        raw = self.r.get(self.k_spares)
        return int(raw) if raw is not None else None

    # -- chaos (tests, demos): what was injected when, and self-check faults per node -------

    def record_chaos(self, kind: str, node: str, detail: Optional[dict] = None) -> None:
        self.r.rpush(self.k_chaos, json.dumps({"kind": kind, "node": node, "time": time.time(), **(detail or {})}))

    def last_chaos(self) -> Optional[dict]:
        raw = self.r.lindex(self.k_chaos, -1)
        return json.loads(raw) if raw else None

    def set_injection(self, node: str, faults: dict) -> None:
        self.r.hset(self.k_inject, node, json.dumps(faults))

    def take_injection(self, node: str) -> dict:
        """The self-check faults injected into `node`, once: its next self-check only."""
        pipe = self.r.pipeline()
        pipe.hget(self.k_inject, node)
        pipe.hdel(self.k_inject, node)
        raw, _ = pipe.execute()
        return json.loads(raw) if raw else {}

    # -- what `status` shows, and the ingestion's resume point -------------------------------

    def write_status(self, status: JobStatus) -> None:
        """The status, and whether the current incarnation trains (its `step` is the current incarnation's)."""
        trains = status.state == JobState.RUNNING.value and status.step is not None
        pipe = self.r.pipeline()
        pipe.set(self.k_status, json.dumps(dataclasses.asdict(status)))
        pipe.set(self.k_training, b"1" if trains else b"0")
        pipe.execute()

    def status(self) -> Optional[JobStatus]:
        raw = self.r.get(self.k_status)
        return JobStatus.from_dict(json.loads(raw)) if raw else None

    def save_offsets(self, topic_id: Optional[str], offsets: dict[int, int]) -> None:
        self.r.set(self.k_offsets, json.dumps({"topic_id": topic_id, "offsets": offsets}))

    def offsets(self) -> tuple[Optional[str], dict[int, int]]:
        raw = self.r.get(self.k_offsets)
        if not raw:
            return None, {}
        data = json.loads(raw)
        return data["topic_id"], {int(p): o for p, o in data["offsets"].items()}

    # -- one driver at a time ----------------------------------------------------------------

    _RENEW = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"

    def acquire_lease(self, holder: str, ttl_s: float) -> bool:
        """Take or renew the driver lease. A killed driver's lease lapses after `ttl_s`."""
        ms = int(ttl_s * 1000)
        if self.r.set(self.k_lease, holder, nx=True, px=ms):
            return True
        return bool(self.r.eval(self._RENEW, 1, self.k_lease, holder, ms))

    def lease_holder(self) -> Optional[str]:
        raw = self.r.get(self.k_lease)
        return raw.decode() if raw else None

    def release_lease(self, holder: str) -> None:
        self.r.eval("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
                    1, self.k_lease, holder)

    # -- commands to executors --------------------------------------------------------------

    def send(self, node: str, op: str, args: Optional[dict] = None) -> int:
        """Queues a command for `node`; returns its seq. The stream is the durable copy: an executor
        that was down reads it when it comes back, and acknowledges by seq."""
        seq = int(self.r.hincrby(self.k_seq, node, 1))
        cmd = Command(job=self.job, node=node, seq=seq, op=op, args=args or {})  # type: ignore[arg-type]
        self.r.xadd(command_stream(self.job, node), {"msg": encode(cmd)}, maxlen=1000, approximate=True)
        return seq

    def acks(self) -> dict[str, Ack]:
        return self._acks(acks_key(self.job))

    def selfchecks(self) -> dict[str, Ack]:
        """The newest background self-check result of each node (its `diagnose` command's seq and report)."""
        return self._acks(selfchecks_key(self.job))

    def _acks(self, key: str) -> dict[str, Ack]:
        out = {}
        for node, raw in self.r.hgetall(key).items():
            try:
                out[node.decode()] = decode(raw, expect=Ack)
            except MessageError:
                continue  # not ours to judge here; the node's next ack replaces it
        return out
