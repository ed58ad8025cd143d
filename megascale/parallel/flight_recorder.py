"""Hang localisation (MegaScale §5.2): every rank records its recent collectives and
P2P operations in a ring buffer kept in a memory-mapped file, so the executor can read
it even while the rank is blocked in a collective or stopped (SIGSTOP, a dead GPU).

`localize_hang` names the ranks the others are waiting for: ranks that never entered
the operation a stuck peer is in, and are not themselves waiting on anyone.
"""
from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from megascale.common.flight_format import HEADER, MAGIC, NO_PEER, OPS, RECORD, OpRecord

class FlightRecorder:
    def __init__(self, path: str | Path, capacity: int = 512):
        self.path, self.capacity = Path(path), capacity
        size = HEADER.size + capacity * RECORD.size
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._written = 0
        self._sequences: dict[tuple[str, int], int] = {}
        HEADER.pack_into(self._map, 0, MAGIC, capacity, 0)

    def begin(self, op: str, group: str, members: int, peer: int = NO_PEER) -> int:
        """Records that this rank entered an operation; returns the slot to pass to `end`."""
        key = (group, peer)
        seq = self._sequences.get(key, 0) + 1
        self._sequences[key] = seq
        slot = self._written % self.capacity
        RECORD.pack_into(self._map, HEADER.size + slot * RECORD.size, seq, OPS.index(op), members,
                          group.encode()[:16], peer, time.time(), 0.0)
        self._written += 1
        HEADER.pack_into(self._map, 0, MAGIC, self.capacity, self._written)
        return slot

    def end(self, slot: int) -> None:
        offset = HEADER.size + slot * RECORD.size + RECORD.size - 8
        struct.pack_into("<d", self._map, offset, time.time())

    def close(self) -> None:
        self._map.close()


@dataclass
class HangReport:
    suspects: list[int]  # ranks the job is waiting for
    waiting: dict[int, str]  # stuck rank -> what it waits in
    reason: str


def localize_hang(records: dict[int, list[OpRecord]], group_members: dict[str, list[int]]) -> HangReport:
    """Names the rank(s) that never entered the operations the others are stuck in.

    `group_members` maps each group name (as recorded) to its global ranks.
    """
    def entered(rank: int, group: str, peer: int) -> int:
        return max((r.seq for r in records.get(rank, []) if r.group == group and r.peer == peer), default=0)

    waits_for: dict[int, set[int]] = {}
    waiting: dict[int, str] = {}
    for rank, ops in records.items():
        stuck = next((r for r in ops if r.ended is None), None)
        if stuck is None:
            continue
        waiting[rank] = (f"{stuck.op} #{stuck.seq} on {stuck.group}"
                         + (f" with rank {stuck.peer}" if stuck.peer >= 0 else ""))
        if stuck.peer >= 0:  # P2P: the peer's matching operation on the same group, towards us
            blockers = {stuck.peer} if entered(stuck.peer, stuck.group, rank) < stuck.seq else set()
        else:
            blockers = {m for m in group_members.get(stuck.group, []) if m != rank
                        and entered(m, stuck.group, NO_PEER) < stuck.seq}
        waits_for[rank] = blockers
    # The root causes wait on nobody themselves (stopped, dead, or stuck outside communication).
    suspects = sorted({b for blockers in waits_for.values() for b in blockers if not waits_for.get(b)})
    if not waiting:
        return HangReport([], {}, "no rank is inside a communication operation")
    if not suspects:
        return HangReport([], waiting, "every stuck rank's peers entered the operation: a network or library hang")
    return HangReport(suspects, waiting, f"rank(s) {suspects} never entered the operation their peers wait in")
