"""Attacks on the heartbeat topic, at the driver's ingestion, in-process: anyone who reaches the broker can
write records, but only the job's own, new heartbeats of the job's own nodes count."""
from __future__ import annotations

import gc
import json
import os
import time

import psutil

from megascale.common.auth import JobSecrets
from megascale.common.messages import Heartbeat, RankStatus, encode
from megascale.config import from_dict
from megascale.driver.ingest import HeartbeatIngest
from megascale.driver.recovery.detection import detect_faults
from megascale.driver.state import JobRecord, JobState, NodeSlot

KEY = JobSecrets.generate()
SIGNER = KEY.signer()


def hb(node: str, seq: int, boot: str = "b1", at: float | None = None, failed: bool = False) -> Heartbeat:
    ranks = [RankStatus(rank=0, local_rank=0, state="failed" if failed else "running", pid=1, exit_code=1 if failed
                        else None)]
    return Heartbeat(job="j", node=node, host="h", ip="127.0.0.1", boot_id=boot, seq=seq,
                     time=time.time() if at is None else at, interval_s=1.0, phase="running", incarnation=1,
                     ranks=ranks)


def ingestion(broker) -> HeartbeatIngest:
    ingest = HeartbeatIngest(broker.bootstrap, "j", signer=SIGNER)
    ingest.members = frozenset({"n0", "n1"})
    return ingest


def test_a_forged_heartbeat_is_dropped_and_counted(broker):
    ingest = ingestion(broker)
    try:
        assert ingest.ingest(encode(hb("n0", 1), SIGNER)) is not None
        forged = hb("n0", 2, failed=True)  # would make the driver see a failed rank and restart the job
        assert ingest.ingest(encode(forged)) is None  # unsigned
        assert ingest.ingest(encode(forged, JobSecrets.generate().signer())) is None  # signed with another key
        assert ingest.ingest(encode(hb("n0", 1), SIGNER).replace(b'"seq":1', b'"seq":3')) is None  # edited
        assert ingest.nodes["n0"].hb.seq == 1 and ingest.nodes["n0"].hb.ranks[0].state == "running"
        assert ingest.ignored == {"unsigned": 1, "bad mac": 2}
    finally:
        ingest.reader.close()


def test_a_replayed_heartbeat_is_dropped_also_from_an_earlier_executor_boot(broker):
    ingest = ingestion(broker)
    t0 = time.time()
    old_boot = [encode(hb("n0", seq, "old", t0 + seq), SIGNER) for seq in (1, 2)]
    try:
        for record in old_boot:
            assert ingest.ingest(record) is not None
        assert ingest.ingest(old_boot[0]) is None and ingest.ingest(old_boot[1]) is None  # same boot, same seq
        assert ingest.ingest(encode(hb("n0", 1, "new", t0 + 3), SIGNER)) is not None  # the executor restarted
        assert ingest.ingest(old_boot[1]) is None  # the dead executor's heartbeat does not come back
        assert ingest.nodes["n0"].hb.boot_id == "new" and ingest.ignored == {"replay": 3}
    finally:
        ingest.reader.close()


def test_a_flood_of_junk_costs_no_memory_and_no_healthy_node(broker):
    ingest = ingestion(broker)
    rec = JobRecord(job="j", config={}, run_dir="/r", state=JobState.RUNNING, incarnation=1,
                    nodes=[NodeSlot("n0", "active", 0, True), NodeSlot("n1", "active", 1, True)])
    cfg = from_dict({"control": {"heartbeat_s": 1.0, "dead_after_s": 2.0}})
    base = encode(hb("n0", 1), SIGNER)
    stranger = encode(hb("stranger", 1))
    kinds = [
        lambda i: base[:-12] + b'%012d' % i,  # bad HMAC (and a different one every time)
        lambda i: SIGNER.sign(stranger.replace(b"stranger", b"s%d" % i)),  # validly signed, but no node of the job
        lambda i: b'{"v":1,"kind":"heartbeat","node":"n%d"' % i,  # malformed JSON
        lambda i: json.dumps({"junk": "x" * (i % 500)}).encode(),  # unsigned
    ]
    junk = 100_000
    gc.collect()
    rss = psutil.Process(os.getpid()).memory_info().rss
    try:
        seq = 1
        for i in range(junk):
            ingest.ingest(kinds[i % len(kinds)](i), f"@{i}")
            if i % 5000 == 0:  # the healthy nodes keep beating through the flood
                for node in ("n0", "n1"):
                    assert ingest.ingest(encode(hb(node, seq), SIGNER)) is not None
                seq += 1
        gc.collect()
        grown_mb = (psutil.Process(os.getpid()).memory_info().rss - rss) / 2**20
        assert grown_mb < 50, f"driver memory grew by {grown_mb:.0f} MB"
        assert set(ingest.nodes) == {"n0", "n1"} and ingest.processed == 2 * (seq - 1)
        assert sum(ingest.ignored.values()) == junk and len(ingest.ignored) <= 4  # counters by reason only
        silence = {n: time.monotonic() - v.received for n, v in ingest.nodes.items()}
        assert detect_faults(rec, ingest.nodes, silence.__getitem__, cfg) == []  # no node declared dead
    finally:
        ingest.reader.close()
