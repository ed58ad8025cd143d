"""Ships StepTimings dicts to `<job>.metrics` in batches without ever slowing the training step.

`publish()` only appends to a bounded queue; a background thread batches (flush on
`max_batch` records or `flush_s` seconds) and sends. When Kafka is slow or down the queue
fills and further records are dropped and counted: timings are telemetry, the step is not.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Optional, Protocol

from megascale.common.auth import env_signer
from megascale.common.messages import Timings, encode, topic


log = logging.getLogger("megascale.driver")


class Sender(Protocol):
    def send(self, topic: str, key: bytes, value: bytes, on_error: Callable[[Exception], None]) -> None: ...
    def close(self) -> None: ...


class KafkaSender:
    """kafka-python underneath; `send` raises when the broker cannot take the record at all."""

    def __init__(self, bootstrap: str, **overrides: Any):
        from kafka import KafkaProducer

        # No idempotence: a restarted broker forgets producer ids and an idempotent producer then
        # fails every send; a duplicated batch is harmless (readers keep one record per rank and step).
        # gzip: a batch of timings is repetitive JSON; the embedded broker, which keeps every message in
        # memory, then grew 7.9 MB instead of 24.5 MB for the same 1,500 batches (a Kafka cluster's disk alike).
        options = dict(bootstrap_servers=bootstrap, enable_idempotence=False, acks=1, linger_ms=20,
                       compression_type="gzip",
                       max_block_ms=2000, request_timeout_ms=5000, delivery_timeout_ms=15000,
                       reconnect_backoff_max_ms=1000, metadata_max_age_ms=5000)
        self.producer = KafkaProducer(**{**options, **overrides})

    def send(self, topic: str, key: bytes, value: bytes, on_error: Callable[[Exception], None]) -> None:
        self.producer.send(topic, key=key, value=value).add_errback(on_error)

    def close(self) -> None:
        self.producer.flush(timeout=5)
        self.producer.close(timeout=2)


class MetricsPublisher:
    """One per rank or per executor. Thread-safe `publish`; `close()` sends what is queued."""

    def __init__(self, job: str, node: str, bootstrap: Optional[str] = None, *, incarnation: Optional[int] = None,
                 max_batch: int = 256, flush_s: float = 1.0, queue_size: int = 10_000,
                 sender: Optional[Sender] = None, retry_s: float = 1.0):
        if sender is None and not bootstrap:
            raise ValueError("MetricsPublisher needs Kafka bootstrap servers (host:port) or a sender")
        self.job, self.node, self.incarnation = job, node, incarnation
        self.topic = topic(job, "metrics")
        self.max_batch, self.flush_s, self.retry_s = max_batch, flush_s, retry_s
        self._bootstrap, self._sender = bootstrap, sender
        self._signer = env_signer()  # the driver drops unsigned batches once the job has a key
        self._queue: queue.Queue[dict] = queue.Queue(maxsize=queue_size)
        self._stop = threading.Event()
        self._give_up_at = float("inf")
        self._lock = threading.Lock()
        self.published = 0  # accepted into the queue
        self.dropped = 0  # queue full
        self.sent = 0  # handed to the producer
        self.failed = 0  # lost in a send that raised
        self._dropped_reported = 0
        self._thread = threading.Thread(target=self._run, name="metrics-publisher", daemon=True)
        self._thread.start()

    def publish(self, timings: dict) -> bool:
        """Queues one StepTimings dict; False (and counted) when the queue is full. Never blocks."""
        try:
            self._queue.put_nowait(timings)
        except queue.Full:
            with self._lock:
                self.dropped += 1
            return False
        with self._lock:
            self.published += 1
        return True

    def stats(self) -> dict:
        with self._lock:
            return {"published": self.published, "dropped": self.dropped, "sent": self.sent, "failed": self.failed,
                    "queued": self._queue.qsize()}

    def close(self, timeout: float = 5.0) -> None:
        """Sends what is queued, retrying for up to `timeout` seconds; what is left then is counted as failed."""
        self._give_up_at = time.monotonic() + max(0.0, timeout - self.retry_s)
        self._stop.set()
        self._thread.join(timeout + 3)  # the producer's own flush and close take up to a few seconds more

    # -- background thread -----------------------------------------------------------------

    def _run(self) -> None:
        batch: list[dict] = []
        deadline = time.monotonic() + self.flush_s
        try:
            while True:
                stopping = self._stop.is_set()
                try:
                    batch.append(self._queue.get(timeout=max(0.0, min(0.1, deadline - time.monotonic()))))
                    while len(batch) < self.max_batch:  # drain what is already there without waiting
                        batch.append(self._queue.get_nowait())
                except queue.Empty:
                    pass
                if batch and (len(batch) >= self.max_batch or time.monotonic() >= deadline or stopping):
                    if not self._send(batch):
                        if not stopping or time.monotonic() < self._give_up_at:
                            time.sleep(self.retry_s)  # keep the batch; the queue bounds what piles up behind it
                            continue
                        self._lost(len(batch), TimeoutError("closing"))
                    batch = []
                if not batch:
                    deadline = time.monotonic() + self.flush_s
                if stopping and not batch and self._queue.empty():
                    break
        finally:
            if self._sender is not None:
                try:
                    self._sender.close()
                except Exception as e:  # shutting down: nothing left to do with the error but say it
                    log.warning("metrics publisher: flush on close failed (%s)", type(e).__name__)

    def _send(self, batch: list[dict]) -> bool:
        with self._lock:
            dropped = self.dropped - self._dropped_reported
        msg = Timings(job=self.job, node=self.node, time=time.time(), records=batch, incarnation=self.incarnation,
                      dropped=dropped)
        try:
            if self._sender is None:
                self._sender = KafkaSender(self._bootstrap)  # type: ignore[arg-type]
            self._sender.send(self.topic, self.node.encode(), encode(msg, self._signer),
                              lambda e, n=len(batch): self._lost(n, e))
        except Exception as e:  # Kafka unreachable: the caller retries; never raised into training
            log.debug("metrics publisher: send failed (%s: %s)", type(e).__name__, e)
            return False
        with self._lock:
            self.sent += len(batch)
            self._dropped_reported += dropped
        return True

    def _lost(self, n: int, error: Exception) -> None:
        with self._lock:
            self.failed += n
        log.debug("metrics publisher: %d records lost (%s)", n, type(error).__name__)
