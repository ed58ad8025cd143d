"""The wire contract between the driver and the executors (schema v1): the only module they share.

Kafka topics carry JSON objects, UTF-8, one per record; node messages are keyed by node id so
one node's messages stay in order within a partition:

    <job>.heartbeats  Heartbeat  each executor, every control.heartbeat_s and at once on a rank change
    <job>.metrics     Metric     one per training step, from the node hosting the reporting rank
                      Timings    batches of every local rank's per-step timer segments (StepTimings dicts)
    <job>.events      Event      the driver's decisions: state changes, faults, commands, nodes

Commands travel through Redis, not Kafka, because a broker restart loses Kafka's data and a
command must not be lost (see `command_stream` / `ACKS`):

    megascale:{<job>}:cmd:<node>  stream, one entry per Command (field "msg"), seq rising per node
    megascale:{<job>}:acks        hash, field <node> = that node's latest Ack
    megascale:{<job>}:slow:<node> hash, field <rank> = a SlowRank fault (`megascale chaos slow-rank`)

Kafka records are signed (`megascale.common.auth`: a last field "mac", HMAC-SHA256 under the
job's key) when the sender has the job's secrets; the driver drops records that fail it.

Every message has "v" (schema version) and "kind". Readers ignore fields they do not know
(added later in a compatible way) and drop, with a log line, anything that is not JSON, has
an unknown kind, a newer "v", or a missing or mistyped field: `decode` raises MessageError.
"""
from __future__ import annotations

import dataclasses
import json
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal, Optional, Union

import msgspec

from megascale.common import typed
from megascale.common.auth import Signer
from megascale.common.jsonl import LineFollower

SCHEMA_VERSION = 1

RankState = Literal["starting", "running", "succeeded", "failed", "stopped"]
ErrorKind = Literal["hardware_error", "nccl_timeout", "cuda_error", "oom", "comm_error", "python_exception"]
NodePhase = Literal["idle", "running", "stopping", "diagnosing", "exiting"]
CommandOp = Literal["start", "stop", "diagnose", "flight", "exit"]
EventType = Literal["state", "fault", "command", "node", "info"]


class MessageError(ValueError):
    """A record that is not a valid message of this schema; the text says why, in one line."""


class WrongKind(MessageError):
    """A valid-looking record of another kind than the reader asked for (topics carry several kinds)."""


@dataclass
class RankStatus:
    rank: int  # global rank
    local_rank: int
    state: RankState
    pid: Optional[int] = None
    exit_code: Optional[int] = None
    step: Optional[int] = None  # known on the reporting rank every step, on the others at the end
    step_time: Optional[float] = None
    loss: Optional[float] = None


@dataclass
class ErrorLine:
    rank: int
    kind: ErrorKind
    line: str  # the matching stderr line, truncated to 300 characters
    time: float


@dataclass
class HostMetrics:
    cpu_percent: float = 0.0
    mem_percent: float = 0.0
    mem_used_bytes: int = 0
    load_1m: float = 0.0
    net_bytes_sent: int = 0  # counters since boot, all NICs
    net_bytes_recv: int = 0
    net_errors: int = 0
    net_drops: int = 0


@dataclass
class Heartbeat:
    job: str
    node: str
    host: str
    ip: str
    boot_id: str  # new every time an executor process starts
    seq: int  # rises by one per heartbeat within a boot_id
    time: float  # sender's wall clock, seconds since the epoch
    interval_s: float
    phase: NodePhase
    incarnation: Optional[int] = None  # job incarnation (rendezvous generation) of `ranks`
    ranks: list[RankStatus] = field(default_factory=list)
    step: Optional[int] = None  # newest step any local rank reported
    step_age_s: Optional[float] = None  # how long before `time` that step (or the end of a wait) was seen
    step_time: Optional[float] = None
    loss: Optional[float] = None
    tokens_per_s: Optional[float] = None
    val_step: Optional[int] = None  # the step of the newest validation (eval.every) and its results
    val_loss: Optional[float] = None
    val_ppl: Optional[float] = None
    restored_step: Optional[int] = None  # the step this incarnation's ranks started from (0: from scratch)
    waiting: Optional[str] = None  # what a local rank is blocked on outside a step, e.g. a checkpoint persisting
    waiting_since: Optional[float] = None  # sender's wall clock
    errors: list[ErrorLine] = field(default_factory=list)  # recent error lines of this incarnation
    metrics: HostMetrics = field(default_factory=HostMetrics)
    kind: Literal["heartbeat"] = "heartbeat"


@dataclass
class Metric:
    job: str
    node: str
    rank: int
    incarnation: int
    step: int
    loss: float
    step_time: float
    tokens_per_s: float
    time: float
    grad_norm: Optional[float] = None
    lr: Optional[float] = None
    val_loss: Optional[float] = None  # on a validation step (eval.every)
    val_ppl: Optional[float] = None
    kind: Literal["metric"] = "metric"


@dataclass
class Timings:
    """A batch of StepTimings dicts (`megascale.timers`) from one node's ranks, on `<job>.metrics`.

    Records stay plain dicts: their segments may grow without a schema change, and readers check
    what they need (`valid_timings`)."""
    job: str
    node: str
    time: float  # sender's wall clock when the batch left
    records: list[dict]
    incarnation: Optional[int] = None
    dropped: int = 0  # records the sender dropped (queue full) since its previous batch
    kind: Literal["timings"] = "timings"


@dataclass
class Event:
    job: str
    type: EventType
    message: str  # one human-readable line
    time: float = field(default_factory=time.time)
    state: Optional[str] = None  # job state after the decision
    previous: Optional[str] = None
    node: Optional[str] = None
    detail: dict = field(default_factory=dict)
    kind: Literal["event"] = "event"


@dataclass
class Command:
    job: str
    node: str
    seq: int  # per node, rising; an executor runs each seq once and acknowledges it
    op: CommandOp
    args: dict = field(default_factory=dict)
    time: float = field(default_factory=time.time)
    kind: Literal["command"] = "command"


@dataclass
class Ack:
    job: str
    node: str
    seq: int
    op: str
    ok: bool
    detail: str = ""
    time: float = field(default_factory=time.time)
    kind: Literal["ack"] = "ack"


@dataclass
class SlowRank:
    """A slow-rank fault (`megascale chaos slow-rank`): the node's executor throttles `rank` by `factor`
    until `until`. Read from Redis by the executor, not a command: a test fault is no step of the driver's."""
    job: str
    node: str
    rank: int
    factor: float
    until: Optional[float] = None  # wall clock; None = until the job ends
    kind: Literal["slow_rank"] = "slow_rank"


Message = Union[Heartbeat, Metric, Timings, Event, Command, Ack, SlowRank]
KINDS: dict[str, type] = {"heartbeat": Heartbeat, "metric": Metric, "timings": Timings, "event": Event,
                          "command": Command, "ack": Ack, "slow_rank": SlowRank}


# -- names ----------------------------------------------------------------------------------

def topic(job: str, name: Literal["heartbeats", "metrics", "events"]) -> str:
    return f"{job}.{name}"


def command_stream(job: str, node: str) -> str:
    return f"megascale:{{{job}}}:cmd:{node}"


def acks_key(job: str) -> str:
    return f"megascale:{{{job}}}:acks"


def selfchecks_key(job: str) -> str:
    """Background self-checks' results, node -> Ack of the `diagnose` command (acks stay in command order)."""
    return f"megascale:{{{job}}}:selfchecks"


def training_key(job: str) -> str:
    """"1" while the job's current incarnation trains (it has made a step), else "0": written by the driver with
    its status, read by the nodes, whose standby processes wait for it (executor/standby.py). A key of its own,
    though the status holds the same: that is rewritten every pass and grows with the nodes it lists."""
    return f"megascale:{{{job}}}:training"


def slow_ranks_key(job: str, node: str) -> str:
    return f"megascale:{{{job}}}:slow:{node}"


# -- encoding -------------------------------------------------------------------------------

def encode(msg: Message, signer: Optional[Signer] = None) -> bytes:
    """The record's bytes; signed (a last field "mac") when given the job's signer."""
    body = json.dumps({"v": SCHEMA_VERSION, **dataclasses.asdict(msg)}, separators=(",", ":")).encode()
    return signer.sign(body) if signer else body


class _Header(msgspec.Struct):
    v: int
    kind: str


_HEADER = msgspec.json.Decoder(_Header)
# The driver decodes every heartbeat: msgspec reads a valid record into the same dataclasses ~5x faster
# than json + typed.read (what kept ingestion under 10,000 heartbeats/s). It refuses what typed.read
# refuses, and some that typed.read takes (NaN, numbers as dict[str, str] text); so anything it refuses
# goes the slow way, which takes it or says why in this schema's words.
_FAST = {kind: msgspec.json.Decoder(cls) for kind, cls in KINDS.items()}


def decode(raw: bytes | str, expect: Optional[type] = None) -> Message:
    """Parses one record; raises MessageError (one line) for anything this schema cannot accept."""
    try:
        header = _HEADER.decode(raw)
        fast = _FAST.get(header.kind) if header.v <= SCHEMA_VERSION else None
        if fast is not None and (expect is None or KINDS[header.kind] is expect):
            return fast.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        pass
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise MessageError("not JSON") from None
    if not isinstance(obj, dict):
        raise MessageError(f"a JSON {type(obj).__name__}, not an object")
    version = obj.get("v")
    if not isinstance(version, int) or isinstance(version, bool):
        raise MessageError("no schema version 'v'")
    if version > SCHEMA_VERSION:
        raise MessageError(f"schema v{version} is newer than this reader's v{SCHEMA_VERSION}")
    cls = KINDS.get(obj.get("kind"))  # type: ignore[arg-type]
    if cls is None:
        raise MessageError(f"unknown kind {obj.get('kind')!r}")
    if expect is not None and cls is not expect:
        raise WrongKind(f"a {obj['kind']}, expected a {expect.__name__.lower()}")
    try:
        return typed.read(cls, obj)
    except typed.Invalid as e:
        raise MessageError(_problem(e, obj["kind"])) from None


def _problem(e: typed.Invalid, kind: str) -> str:
    """The reader's refusal in this schema's words, e.g. `heartbeat.ranks[0].state='zombie': not one of ...`."""
    where = e.at(kind)
    if e.problem == "missing":
        return f"{where}: missing field {e.name!r}"
    if dataclasses.is_dataclass(e.expected):
        return f"{where}: expected an object"
    shown = f"{where}={str(e.value)[:40]!r}"
    if typing.get_origin(e.expected) is Literal:
        return f"{shown}: not one of {', '.join(map(str, typing.get_args(e.expected)))}"
    return f"{shown}: expected {'a list' if typing.get_origin(e.expected) is list else e.expected.__name__}"


def valid_timings(rec: Any) -> bool:
    """Whether `rec` has what every reader needs of a StepTimings dict."""
    if not isinstance(rec, dict) or not isinstance(rec.get("segments"), dict):
        return False
    ints = all(type(rec.get(k)) is int for k in ("step", "rank", "tp", "pp", "dp"))
    return ints and all(isinstance(rec.get(k), (int, float)) for k in ("start", "total"))


def as_timings(line: dict) -> Optional[dict]:
    """A StepTimings dict from a JSONL line that holds one directly or a StepStats with `timings`."""
    rec = line.get("timings") if isinstance(line.get("timings"), dict) else line
    return rec if valid_timings(rec) else None


class JsonlTail:
    """StepTimings dicts from the new whole lines of growing JSONL files, across their rollovers
    (common/jsonl.py). The executor tails its ranks' `timings-rank<R>.jsonl` with it."""

    def __init__(self) -> None:
        self._lines = LineFollower()

    def skip_to_end(self, path: Path) -> None:
        """Only lines written from now on (a new incarnation's)."""
        self._lines.skip_to_end(path)

    def read(self, paths: Iterable[Path]) -> list[dict]:
        return [rec for path in paths for line in self._lines.read(path) if (rec := timings_line(line)) is not None]


def timings_line(line: bytes) -> Optional[dict]:
    """The StepTimings dict of one JSONL line (as_timings), None for a line that holds none or is not JSON."""
    try:
        loaded = json.loads(line)
    except ValueError:
        return None
    return as_timings(loaded) if isinstance(loaded, dict) else None  # a stray `5` or `[]` line is not one either
