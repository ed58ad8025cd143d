"""Heartbeat ingestion: one thread reads `<job>.heartbeats` and keeps each node's newest heartbeat.

The reconcile loop reads `nodes` (a dict swapped entry by entry, safe under the GIL) and
never touches the Kafka consumer, which is not thread-safe.
"""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Optional

from megascale.common.messages import Heartbeat, MessageError, decode, topic

from . import log
from .bus import TopicReader


@dataclass
class NodeView:
    hb: Heartbeat
    received: float  # time.monotonic() when it arrived: liveness never trusts the sender's clock
    wall: float  # time.time() when it arrived, for display


class HeartbeatIngest(threading.Thread):
    def __init__(self, bootstrap: str, job: str, topic_id: Optional[str] = None,
                 offsets: Optional[dict[int, int]] = None, **reader_options):
        super().__init__(name="heartbeat-ingest", daemon=True)
        self.job = job
        self.reader = TopicReader(bootstrap, topic(job, "heartbeats"), offsets, topic_id, **reader_options)
        self.nodes: dict[str, NodeView] = {}
        self.processed = 0
        self.ignored: collections.Counter[str] = collections.Counter()
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                for record in self.reader.poll(200):
                    self.ingest(record.value, f"{record.topic}[{record.partition}]@{record.offset}")
        finally:
            self.reader.close()

    def ingest(self, raw: bytes, where: str = "") -> Optional[Heartbeat]:
        """Takes one record; returns the heartbeat if it was new, None if ignored or a replay."""
        try:
            hb = decode(raw, expect=Heartbeat)
        except MessageError as e:
            self._ignore(where, str(e))
            return None
        if hb.job != self.job:
            self._ignore(where, f"heartbeat of another job {hb.job!r}")
            return None
        prev = self.nodes.get(hb.node)
        if prev is not None and prev.hb.boot_id == hb.boot_id and hb.seq <= prev.hb.seq:
            return None  # re-read after a topic re-creation or a driver restart
        self.nodes[hb.node] = NodeView(hb, time.monotonic(), time.time())
        self.processed += 1
        return hb

    def _ignore(self, where: str, why: str) -> None:
        self.ignored[why] += 1
        n = self.ignored[why]
        if n <= 5 or n % 1000 == 0:  # a flood of junk must not flood the log
            log.warning("ignored message %s: %s%s", where, why, f" ({n} so far)" if n > 1 else "")

    def positions(self) -> tuple[Optional[str], dict[int, int]]:
        return self.reader.positions()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)
