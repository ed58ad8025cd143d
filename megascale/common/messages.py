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

SCHEMA_VERSION = 1

RankState = Literal["starting", "running", "succeeded", "failed", "stopped"]
ErrorKind = Literal["nccl_timeout", "cuda_error", "oom", "comm_error", "python_exception"]
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


Message = Union[Heartbeat, Metric, Timings, Event, Command, Ack]
KINDS: dict[str, type] = {"heartbeat": Heartbeat, "metric": Metric, "timings": Timings, "event": Event,
                          "command": Command, "ack": Ack}


# -- names ----------------------------------------------------------------------------------

def topic(job: str, name: Literal["heartbeats", "metrics", "events"]) -> str:
    return f"{job}.{name}"


def command_stream(job: str, node: str) -> str:
    return f"megascale:{{{job}}}:cmd:{node}"


def acks_key(job: str) -> str:
    return f"megascale:{{{job}}}:acks"


# -- encoding -------------------------------------------------------------------------------

def encode(msg: Message) -> bytes:
    return json.dumps({"v": SCHEMA_VERSION, **dataclasses.asdict(msg)}, separators=(",", ":")).encode()


def decode(raw: bytes | str, expect: Optional[type] = None) -> Message:
    """Parses one record; raises MessageError (one line) for anything this schema cannot accept."""
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
    return _build(cls, obj, obj["kind"])


# Decoding runs for every heartbeat the driver ingests, so each class's field readers are
# compiled once into plain functions; paths for error messages are only built on failure.
_READERS: dict[type, Any] = {}


class _Bad(Exception):
    def __init__(self, path: str, problem: str):
        self.path, self.problem = path, problem


def _build(cls: type, obj: Any, where: str) -> Any:
    try:
        return _reader(cls)(obj)
    except _Bad as e:
        raise MessageError(f"{where}{e.path}{e.problem}") from None


def _reader(cls: type) -> Any:
    if cls not in _READERS:
        _READERS[cls] = None  # recursion guard while the readers of nested classes are built
        hints = typing.get_type_hints(cls)
        fields = [(f.name, _converter(hints[f.name]), f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING) for f in dataclasses.fields(cls)]
        required = [name for name, _, needed in fields if needed]
        converters = [(name, convert) for name, convert, _ in fields]

        def read(obj: Any) -> Any:
            if type(obj) is not dict:
                raise _Bad("", ": expected an object")
            values = {}
            for name, convert in converters:
                if name in obj:
                    try:
                        values[name] = convert(obj[name])
                    except _Bad as e:
                        raise _Bad(f".{name}{e.path}", e.problem) from None
            if len(values) < len(required) or not all(name in values for name in required):
                missing = next(name for name in required if name not in values)
                raise _Bad("", f": missing field {missing!r}")
            return cls(**values)

        _READERS[cls] = read
    return _READERS[cls]


def _bad(value: Any, expected: str) -> _Bad:
    return _Bad("", f"={str(value)[:40]!r}: expected {expected}")


def _exact(kind: type, optional: bool) -> Any:
    """A converter accepting exactly `kind` (bool is not an int here), or None when optional."""
    if kind is float:
        def number(value: Any) -> Optional[float]:
            t = type(value)
            if t is float:
                return value
            if t is int:
                return float(value)
            if value is None and optional:
                return None
            raise _bad(value, "float")
        return number

    def plain(value: Any) -> Any:
        if type(value) is kind or (value is None and optional):
            return value
        raise _bad(value, kind.__name__)
    return plain


def _converter(hint: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    optional = origin is Union and type(None) in args
    if optional:
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in (str, int, float, bool, dict):
        return _exact(hint, optional)
    if dataclasses.is_dataclass(hint):
        inner = _reader(hint) or (lambda value: _READERS[hint](value))  # type: ignore[misc]
        return (lambda value: None if value is None else inner(value)) if optional else inner
    if origin is Literal:
        allowed = frozenset(args)

        def choice(value: Any) -> Any:
            if (type(value) is str and value in allowed) or (value is None and optional):
                return value
            raise _Bad("", f"={str(value)[:40]!r}: not one of {', '.join(map(str, args))}")
        return choice
    if origin is list:
        item = _converter(args[0])

        def items(value: Any) -> Optional[list]:
            if type(value) is not list:
                if value is None and optional:
                    return None
                raise _bad(value, "a list")
            try:
                return [item(v) for v in value]
            except _Bad as e:
                index = next(i for i, v in enumerate(value) if not _ok(item, v))
                raise _Bad(f"[{index}]{e.path}", e.problem) from None
        return items
    raise TypeError(f"messages: no decoder for {hint}")  # a bug in this module


def _ok(convert: Any, value: Any) -> bool:
    try:
        convert(value)
        return True
    except _Bad:
        return False


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
    """StepTimings dicts from the new whole lines of growing JSONL files (a half-written last line
    waits for the next read). The executor tails its ranks' `timings-rank<R>.jsonl` with it."""

    def __init__(self) -> None:
        self.offsets: dict[Path, int] = {}

    def read(self, paths: Iterable[Path]) -> list[dict]:
        out = []
        for path in paths:
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets.get(path, 0))
                    chunk = f.read()
            except FileNotFoundError:
                continue
            end = chunk.rfind(b"\n") + 1
            self.offsets[path] = self.offsets.get(path, 0) + end
            for line in chunk[:end].splitlines():
                try:
                    rec = as_timings(json.loads(line))
                except ValueError:
                    continue
                if rec is not None:
                    out.append(rec)
        return out
