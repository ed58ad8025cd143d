"""Kafka plumbing for the driver: producers that survive a broker restart, and a group-free topic reader.

Only the plain produce/fetch API is used, so a real Kafka cluster and the embedded tansu
broker behave the same. The reader skips consumer groups: joining one costs half the session
timeout, and the driver is the only reader of its topics.

With the job's secrets in the environment (`megascale.common.auth`), producers sign every record
and readers drop, counting them by reason, the records that fail the signature.
"""
from __future__ import annotations

import collections
import time
from typing import Optional

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError

from megascale.common.auth import BadRecord, Signer, env_signer

from . import log

REFRESH_S = 1.0
LOGGED_PER_REASON = 10  # then every 1000th: a flood of junk must not flood the log


def make_producer(bootstrap: str, **overrides) -> KafkaProducer:
    """A producer whose records (encoded messages) are signed with the job's key, when there is one."""
    # No idempotence: a restarted broker forgets producer ids and an idempotent producer then
    # fails every send; our messages are either periodic or harmless to duplicate.
    options = dict(bootstrap_servers=bootstrap, enable_idempotence=False, acks=1, linger_ms=5, max_block_ms=1000,
                   request_timeout_ms=5000, delivery_timeout_ms=15000, reconnect_backoff_max_ms=1000,
                   metadata_max_age_ms=5000)
    signer = env_signer()
    if signer is not None:
        options["value_serializer"] = signer.sign
    return KafkaProducer(**{**options, **overrides})


def ensure_topics(bootstrap: str, names: list[str], partitions: int = 1) -> None:
    """Create the topics if missing. Producers would auto-create them, but with the broker's default
    partition count; creating them first keeps one partition each unless asked otherwise."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
    try:
        for name in names:
            try:
                admin.create_topics([NewTopic(name, partitions, 1)])
            except TopicAlreadyExistsError:
                pass
    finally:
        admin.close()


class TopicReader:
    """Reads every partition of one topic, from given offsets or the start, without a consumer group.

    A broker restart (tansu keeps nothing) or a deleted-and-recreated topic gives the topic a new
    id and restarts its offsets at 0; our old positions would then skip everything up to them,
    so on a new topic id every partition is read again from the start. New partitions (an
    auto-created topic gets the broker's default count) are picked up within `REFRESH_S`.
    """

    def __init__(self, bootstrap: str, topic: str, offsets: Optional[dict[int, int]] = None,
                 topic_id: Optional[str] = None, verify: bool = True, **overrides):
        self.topic = topic
        # verify=False: the caller checks signatures itself (HeartbeatIngest, which counts them with its other drops).
        self.signer: Optional[Signer] = env_signer() if verify else None
        self.rejected: collections.Counter[str] = collections.Counter()  # by BadRecord.reason: a few keys
        self._start = dict(offsets or {})
        self._topic_id = topic_id
        options = dict(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                       auto_offset_reset="earliest", metadata_max_age_ms=2000, reconnect_backoff_max_ms=1000,
                       request_timeout_ms=5000, max_poll_records=5000, fetch_max_wait_ms=100)
        self.consumer = KafkaConsumer(**{**options, **overrides})
        self._assigned: set[int] = set()
        self.offsets: dict[int, int] = {}  # partition -> next offset, as far as this reader has read
        self._next_refresh = 0.0
        self.recreations = 0

    def poll(self, timeout_ms: int = 200) -> list:
        if time.monotonic() >= self._next_refresh:
            self._refresh()
            self._next_refresh = time.monotonic() + REFRESH_S
        if not self._assigned:
            time.sleep(timeout_ms / 1000)
            return []
        try:
            batches = self.consumer.poll(timeout_ms=timeout_ms)
        except KafkaError as e:  # broker gone: keep our positions and try again
            log.debug("poll %s: %s", self.topic, e)
            time.sleep(timeout_ms / 1000)
            return []
        out = []
        for tp, records in batches.items():
            if records:
                self.offsets[tp.partition] = records[-1].offset + 1
                out += records if self.signer is None else self._verified(records)
        return out

    def _verified(self, records: list) -> list:
        """The records that carry the job's signature, with it stripped; the rest dropped and counted."""
        out = []
        for record in records:
            try:
                out.append(record._replace(value=self.signer.open(record.value)))
            except BadRecord as e:
                self.rejected[e.reason] += 1
                n = self.rejected[e.reason]
                if n <= LOGGED_PER_REASON or n % 1000 == 0:
                    log.warning("dropped a record on %s: %s (%d so far)", self.topic, e.reason, n)
        return out

    def _refresh(self) -> None:
        try:
            partitions = self.consumer.partitions_for_topic(self.topic)
        except KafkaError:
            return
        cluster = getattr(self.consumer, "_cluster", None)
        topic_id = cluster.topic_id(self.topic) if cluster is not None and hasattr(cluster, "topic_id") else None
        topic_id = str(topic_id) if topic_id else None
        recreated = bool(topic_id and self._topic_id and topic_id != self._topic_id)
        if topic_id:
            self._topic_id = topic_id
        if not partitions or (partitions == self._assigned and not recreated):
            return
        self.consumer.assign([TopicPartition(self.topic, p) for p in sorted(partitions)])
        if recreated:
            self.recreations += 1
            log.warning("topic %s was re-created (broker restart?): reading it again from the start", self.topic)
            self._start, self.offsets = {}, {}
            fresh = set(partitions)
        else:
            fresh = set(partitions) - self._assigned
        for p in sorted(fresh):
            tp = TopicPartition(self.topic, p)
            if p in self._start:
                self.consumer.seek(tp, self._start.pop(p))
            else:
                self.consumer.seek_to_beginning(tp)
        self._assigned = set(partitions)

    def positions(self) -> tuple[Optional[str], dict[int, int]]:
        """(topic id, partition -> next offset) to resume from after a restart; safe from any thread."""
        return self._topic_id, dict(self.offsets)

    def close(self) -> None:
        self.consumer.close(autocommit=False)
