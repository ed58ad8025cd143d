"""The flight recorder (MegaScale §5.2): every rank records its recent collectives and
P2P operations in a ring buffer kept in a memory-mapped file, so the executor can read
it even while the rank is blocked in a collective or stopped (SIGSTOP, a dead GPU).

The file's format and its reader are `megascale.common.flight_format`'s; the driver's
`megascale.driver.recovery.localization` names the rank a hang waits for from them.
"""
from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path

from megascale.common.flight_format import HEADER, MAGIC, NO_PEER, OPS, RECORD


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
