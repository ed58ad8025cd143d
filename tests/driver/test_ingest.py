"""Heartbeat ingestion through a real broker: junk is logged and ignored, restarts are survived."""
from __future__ import annotations

import logging
import os
import time
from types import SimpleNamespace

from kafka import KafkaAdminClient, KafkaProducer

from megascale.driver.bus import ensure_topics
from megascale.driver.ingest import HeartbeatIngest
from megascale.driver.reconcile import Driver
from megascale.driver.services import JobHandle, Services, bound_broker_memory
from megascale.common.messages import Heartbeat, Metric, encode, topic


def hb(node: str, seq: int, job: str = "j", boot: str = "b") -> bytes:
    return encode(Heartbeat(job=job, node=node, host="h", ip="127.0.0.1", boot_id=boot, seq=seq, time=time.time(),
                            interval_s=1.0, phase="idle"))


def producer(broker) -> KafkaProducer:
    return KafkaProducer(bootstrap_servers=broker.bootstrap, enable_idempotence=False, max_block_ms=5000)


def test_malformed_and_foreign_messages_are_logged_and_ignored(broker, wait, caplog):
    ensure_topics(broker.bootstrap, [topic("j", "heartbeats")])
    p = producer(broker)
    junk = [b"", b"\x00\x01binary", b"{}", b'{"v": 1, "kind": "heartbeat"}', b'"just a string"',
            b'{"v": 7, "kind": "heartbeat"}', b'{"v": 1, "kind": "telemetry", "x": 1}',
            encode(Metric(job="j", node="n0", rank=0, incarnation=1, step=1, loss=1.0, step_time=1.0,
                          tokens_per_s=1.0, time=0.0)),
            hb("n0", 1, job="someone-else")]
    for value in [hb("n0", 1)] + junk + [hb("n0", 2), hb("n0", 2), hb("n1", 1)]:
        p.send(topic("j", "heartbeats"), key=b"x", value=value)
    p.flush()
    ingest = HeartbeatIngest(broker.bootstrap, "j")
    with caplog.at_level(logging.WARNING, logger="megascale.driver"):
        ingest.start()
        try:
            wait(lambda: "n1" in ingest.nodes, 20, "the heartbeat after the junk")
        finally:
            ingest.stop()
            p.close()
    assert ingest.nodes["n0"].hb.seq == 2 and ingest.processed == 3  # the duplicate seq 2 is a replay
    assert ingest.ignored == {"malformed": len(junk) - 1, "other job": 1, "replay": 1}  # counted by reason
    ignored = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ignored message")]
    assert len(ignored) == len(junk) + 1
    assert any("another job 'someone-else'" in m for m in ignored)
    assert any("unknown kind 'telemetry'" in m for m in ignored)


def test_ingestion_resumes_after_a_broker_restart(broker, wait):
    ensure_topics(broker.bootstrap, [topic("j", "heartbeats")])
    p = producer(broker)
    for seq in range(1, 51):  # the reader's position ends far past where the new log starts
        p.send(topic("j", "heartbeats"), key=b"n0", value=hb("n0", seq))
    p.flush()
    ingest = HeartbeatIngest(broker.bootstrap, "j")
    ingest.start()
    try:
        wait(lambda: "n0" in ingest.nodes and ingest.nodes["n0"].hb.seq == 50, 20, "the first heartbeats")
        broker.restart()  # memory storage: topics and offsets are gone
        p.close()
        p = producer(broker)
        for seq in range(1, 4):  # a restarted executor: new boot id, seq from 1
            p.send(topic("j", "heartbeats"), key=b"n0", value=hb("n0", seq, boot="b2"))
        p.flush()
        view = wait(lambda: ingest.nodes["n0"].hb.boot_id == "b2" and ingest.nodes["n0"], 30,
                    "heartbeats from the re-created topic")
        assert ingest.reader.recreations == 1 and view.hb.seq >= 1
    finally:
        ingest.stop()
        p.close()


def test_a_broker_over_its_memory_bound_is_restarted_empty_on_its_port_and_clients_carry_on(broker, tmp_path):
    handle = JobHandle(job="j", redis_url="", kafka=broker.bootstrap, run_dir=str(tmp_path), config_path="",
                       supervisor_pid=os.getpid(), kafka_pid=broker.proc.pid)
    services = Services("", broker.bootstrap, broker=broker)
    first_pid, fresh_mb = broker.proc.pid, broker.rss_mb()
    p = producer(broker)
    for _ in range(400):  # 40 MB of timings nobody will ever read again: tansu keeps them all
        p.send(topic("j", "metrics"), value=b"x" * 100_000)
    p.flush()
    held = broker.rss_mb()
    assert held > fresh_mb + 30, (fresh_mb, held)
    bound_broker_memory(services, handle, max_mb=held + 50)
    assert broker.proc.pid == first_pid  # under its bound: left alone
    bound_broker_memory(services, handle, max_mb=held - 20)
    assert broker.proc.pid != first_pid and handle.kafka_pid == broker.proc.pid and broker.bootstrap == handle.kafka
    assert broker.rss_mb() < held - 20
    for seq in range(1, 4):  # the same producer reconnects to the same port
        p.send(topic("j", "heartbeats"), key=b"n0", value=hb("n0", seq))
    p.flush()
    p.close()
    assert JobHandle.load("j").kafka_pid == broker.proc.pid  # `megascale stop` finds the new pid


def test_the_driver_re_creates_the_job_s_topics_once_its_heartbeat_reader_sees_a_broker_restart(broker):
    driver = Driver.__new__(Driver)  # only the topic upkeep: no Redis, no nodes
    driver.kafka, driver.job, driver._topics_for = broker.bootstrap, "j", 0
    driver.ingest = SimpleNamespace(reader=SimpleNamespace(recreations=0))
    broker.restart()  # memory storage: every topic gone; executors re-create theirs by producing, not "events"
    driver._topics_after_a_broker_restart()
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    try:
        assert admin.list_topics() == []  # the reader has not seen the restart yet
        driver.ingest.reader.recreations = 1
        driver._topics_after_a_broker_restart()
        assert sorted(admin.list_topics()) == ["j.events", "j.heartbeats", "j.metrics"]
    finally:
        admin.close()
