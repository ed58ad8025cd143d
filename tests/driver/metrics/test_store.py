"""Shipping and storing timings: publisher -> a real tansu broker -> consumer -> Parquet -> read API."""
from __future__ import annotations

import json
import os
import threading
import time
from types import SimpleNamespace

import pytest
import yaml

from megascale.cli import main
from megascale.config import from_dict
from megascale.driver.telemetry import Telemetry
from megascale.executor.metrics_publisher import MetricsPublisher
from megascale.driver.metrics.schema import SEGMENTS, decode, encode
from megascale.driver.metrics.sources import RunDirSource
from megascale.driver.metrics.store import MetricsConsumer, ParquetStore

from megascale.common.messages import Metric, Timings, topic
from megascale.common.messages import encode as encode_message


def wait_for(condition, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def key(r: dict) -> tuple[int, int]:
    return r["step"], r["rank"]


def test_segment_names_match_the_timers():
    from megascale.timers import SEGMENTS as TIMER_SEGMENTS

    assert SEGMENTS == TIMER_SEGMENTS


def test_real_run_timings_round_trip_through_kafka_into_parquet(kafka, real_run, tmp_path):
    from megascale.driver.bus import make_producer

    job = "demo"
    store = ParquetStore(tmp_path / "metrics", steps_per_partition=5)
    seen: list[dict] = []
    consumer = MetricsConsumer(kafka, job, store, flush_s=0.2, on_records=seen.extend)
    consumer.start()
    publishers = {node: MetricsPublisher(job, f"node{node}", kafka, incarnation=1, max_batch=16, flush_s=0.1)
                  for node in (0, 1)}
    try:
        for r in real_run:
            assert publishers[r["rank"] // 2].publish(r)
        # The control plane's own messages share the topic: a metric is skipped, junk is counted.
        other = make_producer(kafka, max_block_ms=10_000)  # a loaded host can take seconds for metadata
        other.send(topic(job, "metrics"), encode_message(Metric(job=job, node="node0", rank=0, incarnation=1, step=1,
                                                                loss=3.0, step_time=0.1, tokens_per_s=10.0, time=1.0)))
        other.send(topic(job, "metrics"), b"not json")
        other.flush(timeout=5)
        other.close()
        for p in publishers.values():
            p.close()
        for p in publishers.values():
            assert p.stats()["sent"] == p.stats()["published"] and p.stats()["dropped"] == 0
        wait_for(lambda: consumer.stored >= len(real_run) and consumer.ignored >= 1, what="every record stored")
    finally:
        consumer.stop()
    assert consumer.error is None and consumer.ignored == 1
    assert sorted(map(key, seen)) == sorted(map(key, real_run))

    back = store.read(job)
    assert [key(r) for r in back] == sorted(map(key, real_run))  # one row per (step, rank), sorted
    original = {key(r): r for r in real_run}
    for r in back:
        want = original[key(r)]
        assert (r["tp"], r["pp"], r["dp"], r["incarnation"]) == (want["tp"], want["pp"], want["dp"], 1)
        assert r["node"] == f"node{r['rank'] // 2}"
        assert r["total"] == pytest.approx(want["total"]) and r["start"] == pytest.approx(want["start"])
        assert r["segments"] == pytest.approx(want["segments"])
    steps = sorted({r["step"] for r in real_run})
    assert store.step_range(job) == (steps[0], steps[-1])
    window = store.read(job, 5, 9)
    assert {r["step"] for r in window} == {5, 6, 7, 8, 9} and len(window) == 5 * 4
    assert store.read_table(job, 5, 9).num_rows == 20
    folders = sorted(p.name for p in (tmp_path / "metrics" / f"job={job}").iterdir() if p.is_dir())
    assert folders == ["steps=000000000-000000004", "steps=000000005-000000009", "steps=000000010-000000014"]

    # A restarted consumer resumes after what was stored: only the new record arrives.
    late = {**real_run[0], "step": steps[-1] + 1}
    again = MetricsConsumer(kafka, job, store, flush_s=0.2)
    again.start()
    publisher = MetricsPublisher(job, "node0", kafka, incarnation=1, flush_s=0.05)
    try:
        publisher.publish(late)
        publisher.close()
        wait_for(lambda: again.stored >= 1, what="the late record")
        time.sleep(0.5)  # anything re-read would arrive with it
    finally:
        again.stop()
    assert again.stored == 1
    assert store.step_range(job) == (steps[0], steps[-1] + 1)


def test_timings_batches_travel_gzipped(kafka, real_run):
    """The broker keeps what it is sent (the embedded one in memory): a batch of timings goes compressed."""
    from megascale.executor.metrics_publisher import KafkaSender

    sender = KafkaSender(kafka)
    errors: list[Exception] = []
    try:
        for start in range(0, len(real_run), 16):
            batch = Timings(job="demo", node="node0", time=time.time(), records=real_run[start:start + 16])
            sender.send(topic("demo", "metrics"), b"node0", encode_message(batch), errors.append)
        sender.producer.flush(timeout=10)
        rate = sender.producer.metrics()["producer-metrics"]["compression-rate-avg"]
    finally:
        sender.close()
    assert not errors and 0 < rate < 0.5  # compressed size / original size


class GatedSender:
    """A sender stuck until `gate` opens, as a producer is when the broker is unreachable."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.batches: list[dict] = []

    def send(self, topic_name: str, key: bytes, value: bytes, on_error) -> None:
        self.gate.wait(10)
        self.batches.append(json.loads(value))

    def close(self) -> None:
        pass


def test_publisher_never_blocks_the_step_and_counts_what_it_drops(real_run):
    sender = GatedSender()
    publisher = MetricsPublisher("demo", "node0", sender=sender, queue_size=8, max_batch=4, flush_s=0.02)
    started = time.perf_counter()
    accepted = [publisher.publish(r) for r in real_run]
    elapsed = time.perf_counter() - started
    assert elapsed < 0.5, f"publish blocked for {elapsed:.2f} s"
    stats = publisher.stats()
    assert stats["dropped"] == accepted.count(False) > 0
    sender.gate.set()
    publisher.close()
    sent = [r for b in sender.batches for r in b["records"]]
    assert len(sent) == accepted.count(True) == publisher.stats()["sent"]
    assert all(len(b["records"]) <= 4 for b in sender.batches)
    assert sum(b["dropped"] for b in sender.batches) == stats["dropped"]  # the store learns what was lost


def test_batch_encoding_round_trips_and_skips_other_kinds(real_run):
    batch = decode(encode(Timings(job="demo", node="node1", time=1.0, records=real_run[:3], incarnation=2,
                                 dropped=5)))
    assert (batch.job, batch.node, batch.incarnation, batch.dropped) == ("demo", "node1", 2, 5)
    assert batch.records == real_run[:3]
    assert decode(b'{"v":1,"kind":"metric"}') is None


def test_retention_compaction_and_replayed_steps(real_run, tmp_path):
    store = ParquetStore(tmp_path, steps_per_partition=5, max_steps=6)
    store.write("demo", real_run, node="node0", incarnation=1)
    replay = [r for r in real_run if r["step"] in (11, 12)]  # a restart from a checkpoint re-runs steps 11-12
    store.write("demo", [{**r, "total": 9.0} for r in replay], node="node0", incarnation=2)
    assert {r["total"] for r in store.read("demo", 11, 12)} == {9.0}  # the newest incarnation wins
    assert len(store.read("demo")) == len(real_run)
    assert store.compact("demo", before_step=10) == 0  # closed ranges have one file each already
    store.write("demo", real_run[:1], node="node0", incarnation=1)  # a late record for a closed range
    assert store.compact("demo", before_step=10) == 1
    assert len(list((store.job_dir("demo") / "steps=000000000-000000004").glob("part-*.parquet"))) == 1
    open_range = store.job_dir("demo") / "steps=000000010-000000014"
    store.write("demo", real_run[-2:], node="node0", incarnation=2)  # the open range gathers flushes ...
    assert store.compact("demo", before_step=10, max_files=3) == 1  # ... and is merged once there are many
    assert len(list(open_range.glob("part-*.parquet"))) == 1
    store.apply_retention("demo")  # newest 14, keep 6 steps: from 9; range 0-4 goes, 5-9 stays
    assert store.step_range("demo")[0] == 5
    aged = ParquetStore(tmp_path, steps_per_partition=5, max_age_s=60)
    old = store.job_dir("demo") / "steps=000000005-000000009"
    for f in old.glob("part-*.parquet"):
        os.utime(f, (time.time() - 3600, time.time() - 3600))
    aged.apply_retention("demo")
    assert not old.exists() and store.step_range("demo")[0] == 10
    with pytest.raises(ValueError, match="not usable as a directory name"):
        store.write("../escape", real_run[:1])


def test_run_dir_is_read_incrementally_and_waits_for_whole_lines(real_run, tmp_path, facts):
    run = facts.write_run_dir(tmp_path / "run", [r for r in real_run if r["step"] <= 3])
    source = RunDirSource(run)
    assert (source.job, source.ranks_per_node, source.step_range()) == ("demo", 2, (1, 3))
    line = json.dumps({"step": 4, "loss": 1.0, "timings": {**real_run[0], "step": 4}})  # a StepStats line works too
    with open(run / "timings-rank0.jsonl", "a") as f:
        f.write(line[:20])
    assert source.step_range() == (1, 3)
    with open(run / "timings-rank0.jsonl", "a") as f:
        f.write(line[20:] + "\n")
    assert source.step_range() == (1, 4) and [r["rank"] for r in source.read(4, 4)] == [0]
    assert source.status()["state"] == "finished"


def test_a_long_runs_timings_files_stay_bounded_and_the_dashboard_reads_their_newest_steps(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({
        "name": "rolled", "model": {"layers": 1, "hidden": 16, "heads": 2, "ffn": 32, "vocab": 32, "seq": 8},
        "batch": {"micro": 1, "global": 1}, "train": {"steps": 40, "run_dir": str(tmp_path / "runs")},
        "logging": {"jsonl_max_mb": 0.002, "tensorboard": False}}))  # ~2 KB: a few steps' timings a part
    assert main(["train", str(config), "--quiet"]) == 0
    (run,) = (tmp_path / "runs").iterdir()
    parts = sorted(p.name for p in run.glob("timings-rank*.jsonl"))
    assert parts == ["timings-rank0.1.jsonl", "timings-rank0.jsonl"]
    assert all((run / p).stat().st_size < 2 * 2**20 * 0.002 for p in parts)
    first, last = RunDirSource(run).step_range()
    assert last == 40 and first > 1  # the oldest steps rolled off
    assert [r["step"] for r in RunDirSource(run).read()] == list(range(first, 41))  # both parts, in order, once


def _timings(step: int, rank: int, total: float = 1.0) -> dict:
    return {"step": step, "rank": rank, "tp": rank % 2, "pp": 0, "dp": rank // 2, "start": 100.0 + step,
            "total": total, "segments": {"forward": total / 2, "backward": total / 2}}


def test_a_run_directory_source_holds_the_newest_steps_compactly_and_the_newest_line_of_a_replayed_step(
        tmp_path, facts):
    run = facts.write_run_dir(tmp_path / "run", [_timings(s, r) for s in range(1, 301) for r in range(4)])
    source = RunDirSource(run, keep_steps=100)
    assert source.step_range() == (201, 300)  # ranks' files read one after another, trimmed to the newest 100
    assert [(r["step"], r["rank"]) for r in source.read()] == [(s, r) for s in range(201, 301) for r in range(4)]
    # a dict a parsed line took ~2 KB: 4 ranks x 100,000 steps held ~0.8 GB; now ~150 bytes a rank-step
    assert source._table.nbytes / source._table.num_rows < 200
    with open(run / "timings-rank1.jsonl", "a") as f:  # resumed from a checkpoint at 280: 281-300 replayed
        f.write("".join(json.dumps(_timings(s, 1, total=2.0)) + "\n" for s in range(281, 311)))
    assert source.step_range() == (211, 310)
    replayed = source.read(281, 300)
    assert len(replayed) == 80 and {r["total"] for r in replayed if r["rank"] == 1} == {2.0}
    assert {r["total"] for r in replayed if r["rank"] != 1} == {1.0}
    assert RunDirSource(run, keep_steps=None).step_range() == (1, 310)  # None: all that is on disk
    assert source.read(5000) == [] and source.read(290, 289) == []


def test_trace_and_dashboard_take_keep_steps_and_refuse_a_negative_one(tmp_path, facts, capsys):
    run = facts.write_run_dir(tmp_path / "run", [_timings(s, r) for s in range(1, 51) for r in range(4)])
    out = tmp_path / "trace.json"
    assert main(["trace", "--run-dir", str(run), "--keep-steps", "10", "--steps", "1:50", "-o", str(out)]) == 0
    steps = {e["args"]["step"] for e in json.loads(out.read_text())["traceEvents"] if "step" in e.get("args", {})}
    assert steps == set(range(41, 51))
    assert main(["trace", "--run-dir", str(run), "--keep-steps", "0", "--steps", "1:50", "-o", str(out)]) == 0
    assert {e["args"]["step"] for e in json.loads(out.read_text())["traceEvents"]
            if "step" in e.get("args", {})} == set(range(1, 51))
    assert main(["trace", "--run-dir", str(run), "--keep-steps", "-1", "-o", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: --keep-steps must be 0 (all) or more"


def test_the_drivers_store_keeps_what_the_job_config_says(tmp_path, real_run):
    cfg = from_dict({"logging": {"timings_keep_steps": 1000, "timings_keep_days": 7}})
    telemetry = Telemetry(SimpleNamespace(job="kept"), cfg, "127.0.0.1:1", str(tmp_path))  # its threads not started
    store = telemetry.timings
    assert (store.max_steps, store.max_age_s) == (1000, 7 * 86400)
    for step in (10, 1010, 2010, 3010):  # one row in each of four 1,000-step ranges
        store.write("kept", [{**real_run[0], "step": step}])
    store.apply_retention("kept")  # newest 3010, keep 1,000 steps: from 2011; ranges wholly before it go
    assert store.step_range("kept") == (2010, 3010)
    assert Telemetry(SimpleNamespace(job="all"), from_dict({}), "127.0.0.1:1", str(tmp_path)).timings.max_steps is None
