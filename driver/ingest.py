"""Heartbeat ingestion: one thread reads `<job>.heartbeats` and keeps each node's newest heartbeat.

The reconcile loop reads `nodes` (a dict swapped entry by entry, safe under the GIL) and
never touches the Kafka consumer, which is not thread-safe.

Anyone who can reach the broker can write to the topic, so a heartbeat counts only if it carries
the job's HMAC (when the job has a key), names a node of the job record (`members`, set by the
reconcile loop), and is newer than what that node sent before: a higher seq within one executor
boot, a later send time across boots, so a replayed heartbeat never revives a node. Everything
else is dropped and counted under a few fixed reasons (`ignored`), so a flood of junk costs
neither memory nor liveness.
"""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Optional

from megascale.common.auth import BadRecord, Signer, env_signer
from megascale.common.messages import Heartbeat, MessageError, decode, topic

from . import log
from .bus import LOGGED_PER_REASON, TopicReader


@dataclass
class NodeView:
    hb: Heartbeat
    received: float  # time.monotonic() when it arrived: liveness never trusts the sender's clock
    wall: float  # time.time() when it arrived, for display


class HeartbeatIngest(threading.Thread):
    def __init__(self, bootstrap: str, job: str, topic_id: Optional[str] = None,
                 offsets: Optional[dict[int, int]] = None, signer: Optional[Signer] = None, **reader_options):
        super().__init__(name="heartbeat-ingest", daemon=True)
        self.job = job
        self.reader = TopicReader(bootstrap, topic(job, "heartbeats"), offsets, topic_id, verify=False,
                                  **reader_options)
        self.signer = signer or env_signer()  # None: a job without secrets (a bare test or benchmark)
        self.members: Optional[frozenset[str]] = None  # the job record's nodes; None: any node
        self.nodes: dict[str, NodeView] = {}
        self.processed = 0
        self.ignored: collections.Counter[str] = collections.Counter()  # by reason: a few fixed keys
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                for record in self.reader.poll(200):
                    self.ingest(record.value, f"{record.topic}[{record.partition}]@{record.offset}")
        finally:
            self.reader.close()

    def ingest(self, raw: bytes, where: str = "") -> Optional[Heartbeat]:
        """Takes one record; returns the heartbeat if it was new, None if dropped (and counted)."""
        try:
            hb = decode(raw if self.signer is None else self.signer.open(raw), expect=Heartbeat)
        except BadRecord as e:
            return self._ignore(where, e.reason, "not signed with the job's key")
        except MessageError as e:
            return self._ignore(where, "malformed", str(e))
        if hb.job != self.job:
            return self._ignore(where, "other job", f"heartbeat of another job {hb.job!r}")
        members = self.members
        if members is not None and hb.node not in members:
            return self._ignore(where, "unknown node", f"node {hb.node[:40]!r} is not in the job record")
        prev = self.nodes.get(hb.node)
        if prev is not None and (hb.seq <= prev.hb.seq if prev.hb.boot_id == hb.boot_id else hb.time <= prev.hb.time):
            # also what a driver restart or a re-created topic re-reads
            return self._ignore(where, "replay", f"node {hb.node!r} sent newer (boot {prev.hb.boot_id}, "
                                f"seq {prev.hb.seq})")
        self.nodes[hb.node] = NodeView(hb, time.monotonic(), time.time())
        self.processed += 1
        return hb

    def _ignore(self, where: str, reason: str, detail: str) -> None:
        self.ignored[reason] += 1
        n = self.ignored[reason]
        if n <= LOGGED_PER_REASON or n % 1000 == 0:
            log.warning("ignored message %s: %s (%s, %d so far)", where, detail, reason, n)

    def positions(self) -> tuple[Optional[str], dict[int, int]]:
        return self.reader.positions()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)
