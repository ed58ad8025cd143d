"""The flight recorder's file format (MegaScale §5.2): a ring buffer of the operations a rank entered,
written by the rank (`megascale.parallel.flight_recorder.FlightRecorder`) and read by the executor
and the driver even while the rank is hung or dead.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# Header: magic, capacity, records written. Record: seq, op, group, peer, enqueue, end.
HEADER = struct.Struct("<8sqq")
RECORD = struct.Struct("<qii16sidd")
MAGIC = b"MSFLIGHT"
OPS = ("all_reduce", "all_gather", "reduce_scatter", "send", "recv")
NO_PEER = -1


@dataclass(frozen=True)
class OpRecord:
    seq: int  # per (group, peer) sequence number: the n-th such operation this rank entered
    op: str
    group: str  # group name + first member, e.g. "dp:0"; unique within the job
    members: int  # group size
    peer: int  # global rank of the P2P peer, or -1 for a collective
    enqueued: float
    ended: Optional[float]  # None: still in flight (or never waited on)


def read_records(path: str | Path) -> list[OpRecord]:
    """The ring buffer of a (possibly hung or dead) rank, oldest first."""
    data = Path(path).read_bytes()
    magic, capacity, written = HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise ValueError(f"{path}: not a flight-recorder file")
    count = min(written, capacity)
    first = written - count
    records = []
    for n in range(first, written):
        seq, op, members, group, peer, enqueued, ended = RECORD.unpack_from(
            data, HEADER.size + (n % capacity) * RECORD.size)
        records.append(OpRecord(seq, OPS[op], group.rstrip(b"\0").decode(), members, peer, enqueued,
                                ended or None))
    return records
