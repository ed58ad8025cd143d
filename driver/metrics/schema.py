"""The `timings` record on `<job>.metrics`: a batch of StepTimings dicts from one node.

It follows `megascale.messages` conventions ("v", "kind", JSON, keyed by node) so the
control plane's readers can tell it apart from a `metric`. Until messages.py defines a
`Timings` kind, the format is defined here; both spell the same fields.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

# megascale.timers.SEGMENTS, spelled out: the driver and the dashboard must not import torch
# just to name them (a test keeps the two equal).
SEGMENTS = ("data", "forward", "backward", "optimizer", "comm_tp", "comm_pp", "comm_dp",
            "exposed_tp", "exposed_pp", "exposed_dp")
VERSION = 1
KIND = "timings"


class RecordError(ValueError):
    """A record that is not a valid timings batch; the text says why, in one line."""


@dataclass
class TimingsBatch:
    job: str
    node: str
    records: list[dict]  # StepTimings.to_dict() of one or more (rank, step)
    time: float = field(default_factory=time.time)
    incarnation: Optional[int] = None
    dropped: int = 0  # records the sender dropped (queue full) since its previous batch
    kind: str = KIND


def encode(batch: TimingsBatch) -> bytes:
    body = {"v": VERSION, "kind": KIND, "job": batch.job, "node": batch.node, "time": batch.time,
            "incarnation": batch.incarnation, "dropped": batch.dropped, "records": batch.records}
    return json.dumps(body, separators=(",", ":")).encode()


def decode(raw: bytes | str) -> Optional[TimingsBatch]:
    """The batch in `raw`; None for another kind of message on the same topic (a `metric`)."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise RecordError("not JSON") from None
    if not isinstance(obj, dict):
        raise RecordError("not a JSON object")
    if obj.get("kind") != KIND:
        return None
    if not isinstance(obj.get("v"), int) or obj["v"] > VERSION:
        raise RecordError(f"timings schema v{obj.get('v')!r} is not readable by v{VERSION}")
    if not isinstance(obj.get("job"), str) or not isinstance(obj.get("records"), list):
        raise RecordError("timings batch without 'job' or 'records'")
    records = [r for r in obj["records"] if valid_timings(r)]
    return TimingsBatch(job=obj["job"], node=str(obj.get("node", "")), records=records,
                        time=float(obj.get("time") or 0.0), incarnation=obj.get("incarnation"),
                        dropped=int(obj.get("dropped") or 0))


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


def segment_names(records: list[dict]) -> list[str]:
    """The timer segments in canonical order, then any others the records carry."""
    extra = sorted({name for r in records for name in r["segments"]} - set(SEGMENTS))
    return list(SEGMENTS) + extra
