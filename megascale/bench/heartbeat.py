"""`megascale bench heartbeat`: how many heartbeats the driver's ingestion takes per second, and how late.

Simulated nodes (in separate processes, as real nodes are) publish realistic heartbeats
(8 ranks each, ~1.3 KB) through a real tansu broker; the driver's own `HeartbeatIngest`
reads them. Two measurements:

  capacity  a backlog of N nodes x R rounds is published first, then ingested flat out:
            `heartbeats_per_s` (goal >= 10,000)
  live      M nodes each publishing at 1 Hz for D seconds: the rate kept up with and
            `lag_p99_s`, the time from a node stamping a heartbeat to the driver taking it

Every heartbeat carries the job's HMAC, as in a real job, and the ingestion checks it.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from typing import Optional

from megascale.common.auth import JobSecrets, Signer
from megascale.common.messages import Heartbeat, HostMetrics, RankStatus, encode, topic

from megascale.driver.bus import ensure_topics, make_producer
from megascale.driver.ingest import HeartbeatIngest
from megascale.driver.services import EmbeddedKafka

JOB = "bench"
GOAL = 10_000
SIMULATORS = 2


def _template(node: str) -> tuple[bytes, bytes]:
    """A heartbeat's bytes split around seq and time, so simulators only format two numbers."""
    hb = Heartbeat(job=JOB, node=node, host=f"host-{node}", ip="10.0.0.1", boot_id="sim", seq=-7, time=-7.5,
                   interval_s=1.0, phase="running", incarnation=1, step=1234, step_time=0.71, loss=2.345,
                   tokens_per_s=123456.0, metrics=HostMetrics(cpu_percent=50.0, mem_percent=40.0),
                   ranks=[RankStatus(rank=i, local_rank=i, state="running", pid=1000 + i, step=1234, step_time=0.71,
                                     loss=2.345) for i in range(8)])
    head, tail = encode(hb).split(b'"seq":-7,"time":-7.5')
    return head + b'"seq":', tail


def _simulate(bootstrap: str, key: str, nodes: list[str], rounds: int, rate_hz: Optional[float], ready, go,
              failed) -> None:
    sign = Signer(bytes.fromhex(key)).sign
    producer = make_producer(bootstrap, linger_ms=20, batch_size=512 * 1024, max_block_ms=30000,
                             value_serializer=None)  # signed here, as executors do
    templates = [(n.encode(), *_template(n)) for n in nodes]
    ready.set()
    go.wait()
    name = topic(JOB, "heartbeats")
    start = time.time()
    for r in range(rounds):
        for i, (key, head, tail) in enumerate(templates):
            if rate_hz:  # spread each node's beat over the second, like unsynchronised real nodes
                due = start + r / rate_hz + i / (len(templates) * rate_hz)
                if due - time.time() > 0.005:
                    time.sleep(due - time.time())
            now = time.time()
            future = producer.send(name, key=key, value=sign(head + b"%d,\"time\":%r" % (r + 1, now) + tail))
            future.add_errback(lambda _: _count(failed))
    producer.flush()
    producer.close()


def _count(counter) -> None:
    with counter.get_lock():
        counter.value += 1


class _TimedIngest(HeartbeatIngest):
    """The driver's ingestion, plus one subtraction per heartbeat to record its lag."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lags: list[float] = []

    def ingest(self, raw: bytes, where: str = ""):
        hb = super().ingest(raw, where)
        if hb is not None:
            self.lags.append(time.time() - hb.time)
        return hb


_CTX = mp.get_context("spawn")  # a clean interpreter per simulated rack, no inherited threads
FAILED = _CTX.Value("i", 0)  # sends the broker never acknowledged


def _publish(bootstrap: str, key: str, nodes: int, rounds: int, rate_hz: Optional[float]) -> list:
    names = [f"n{i}" for i in range(nodes)]
    ready = [_CTX.Event() for _ in range(SIMULATORS)]
    go = _CTX.Event()
    procs = [_CTX.Process(target=_simulate, daemon=True,
                          args=(bootstrap, key, names[k::SIMULATORS], rounds, rate_hz, ready[k], go, FAILED))
             for k in range(SIMULATORS)]
    for p in procs:
        p.start()
    for e, p in zip(ready, procs):
        while not e.wait(0.1):
            if not p.is_alive():
                _join(procs, 0)
                raise RuntimeError(f"a heartbeat simulator exited with code {p.exitcode}")
    go.set()
    return procs


def _join(procs: list, timeout: float) -> None:
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"heartbeat simulators exited with codes {[p.exitcode for p in procs]}")


def _drain(ingest: _TimedIngest, expected: int, timeout: float) -> float:
    """Seconds from the first heartbeat taken to the last (or to the timeout)."""
    deadline = time.monotonic() + timeout
    while ingest.processed == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    first = time.monotonic()
    while ingest.processed < expected and time.monotonic() < deadline:
        time.sleep(0.005)
    return time.monotonic() - first


def _pct(values: list[float], q: float) -> float:
    return round(statistics.quantiles(values, n=100)[q - 1], 4) if len(values) >= 100 else round(max(values), 4)


def run(args) -> dict:
    quick = bool(getattr(args, "quick", False))
    nodes, rounds = (2_000, 5) if quick else (10_000, 6)
    live_nodes, live_s = (1_000, 5) if quick else (5_000, 15)
    key = JobSecrets.generate().hmac_key
    broker = EmbeddedKafka().start()
    try:
        # capacity: publish the backlog, then let the driver's ingestion loose on it
        ensure_topics(broker.bootstrap, [topic(JOB, "heartbeats")])
        _join(_publish(broker.bootstrap, key, nodes, rounds, None), timeout=120)
        ingest = _TimedIngest(broker.bootstrap, JOB, signer=Signer(bytes.fromhex(key)))
        ingest.start()
        backlog = nodes * rounds
        elapsed = _drain(ingest, backlog, timeout=120)
        capacity = ingest.processed / elapsed if elapsed else 0.0
        taken = ingest.processed
        ingest.stop()

        # live: nodes at 1 Hz on a fresh topic; lag is stamp-to-ingest
        broker.restart()
        ensure_topics(broker.bootstrap, [topic(JOB, "heartbeats")])
        ingest = _TimedIngest(broker.bootstrap, JOB, signer=Signer(bytes.fromhex(key)))
        ingest.start()
        _join(_publish(broker.bootstrap, key, live_nodes, live_s, 1.0), timeout=live_s + 60)
        _drain(ingest, live_nodes * live_s, timeout=15)
        ingest.stop()
        lags = ingest.lags or [float("nan")]
    finally:
        broker.stop(kill=True)
    result = {
        "heartbeats_per_s": round(capacity),
        "lag_p99_s": _pct(lags, 99),
        "lag_p50_s": _pct(lags, 50),
        "goal_heartbeats_per_s": GOAL,
        "meets_goal": capacity >= GOAL,
        "hmac": "sha256",
        "rejected": dict(ingest.ignored),
        "backlog_heartbeats": backlog,
        "backlog_ingested": taken,
        "live_nodes": live_nodes,
        "live_seconds": live_s,
        "live_heartbeats": ingest.processed,
        "live_heartbeats_expected": live_nodes * live_s,
        "send_failures": FAILED.value,
        "heartbeat_bytes": len(_template("n0")[0]) + len(_template("n0")[1]) + 24 + 74,  # 74: the "mac" field
        "broker": "tansu (embedded, memory)",
        "cpus": os.cpu_count(),
        "load_1m": round(os.getloadavg()[0], 1),
    }
    return result
