"""Step timings at rest: Parquet files partitioned by job and step range, and the Kafka consumer filling them.

    <root>/job=<job>/steps=<lo>-<hi>/part-<ns>.parquet   one row per (rank, step); lo, hi zero-padded
    <root>/job=<job>/_offsets.json                        where the consumer resumes (written after each flush)
    <root>/job=<job>/status.json                          the driver's latest status dict, for the dashboard

Files are written whole (temporary name, then rename), so a reader never sees half a file; a
closed step range, or one that has gathered 64 files, is compacted into one file. Kafka delivers
at least once and a restarted job replays steps from its checkpoint, so readers keep one row per
(step, rank): the newest incarnation, then the newest write.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from megascale.common.messages import topic

from .schema import SEGMENTS, RecordError, decode

log = logging.getLogger("megascale.driver")

_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_PARTITION = re.compile(r"^steps=(\d+)-(\d+)$")
SCHEMA = pa.schema([("step", pa.int64()), ("rank", pa.int32()), ("tp", pa.int32()), ("pp", pa.int32()),
                    ("dp", pa.int32()), ("start", pa.float64()), ("total", pa.float64())]
                   + [(f"seg_{name}", pa.float64()) for name in SEGMENTS]
                   + [("node", pa.string()), ("incarnation", pa.int64()), ("received", pa.float64())])


def check_job(job: str) -> str:
    if not _JOB_NAME.match(job or ""):
        raise ValueError(f"job name {job!r} is not usable as a directory name (letters, digits, . _ -)")
    return job


def to_table(records: list[dict], node: str = "", incarnation: Optional[int] = None) -> pa.Table:
    now = time.time()
    cols: dict[str, list] = {name: [] for name in SCHEMA.names}
    for r in records:
        for key in ("step", "rank", "tp", "pp", "dp", "start", "total"):
            cols[key].append(r[key])
        for name in SEGMENTS:
            cols[f"seg_{name}"].append(float(r["segments"].get(name, 0.0)))
        cols["node"].append(r.get("node", node))
        cols["incarnation"].append(r.get("incarnation", incarnation))
        cols["received"].append(now)
    return pa.Table.from_pydict(cols, schema=SCHEMA)


def to_records(table: pa.Table) -> list[dict]:
    """StepTimings dicts (plus `node`, `incarnation`) from a table of SCHEMA rows."""
    out = []
    for row in table.to_pylist():
        segments = {name: row.pop(f"seg_{name}") for name in SEGMENTS}
        row.pop("received", None)
        out.append({**row, "segments": segments})
    return out


def dedupe(table: pa.Table) -> pa.Table:
    """One row per (step, rank): the newest incarnation, then the newest write; sorted by step, rank."""
    if table.num_rows == 0:
        return table
    incarnation = table["incarnation"].to_numpy(zero_copy_only=False)
    incarnation = np.where(np.isnan(incarnation.astype(float)), -1, incarnation).astype(np.int64)
    order = np.lexsort((table["received"].to_numpy(), incarnation, table["rank"].to_numpy(),
                        table["step"].to_numpy()))
    steps, ranks = table["step"].to_numpy()[order], table["rank"].to_numpy()[order]
    last = np.ones(len(order), dtype=bool)  # the last row of each (step, rank) run wins
    last[:-1] = (steps[1:] != steps[:-1]) | (ranks[1:] != ranks[:-1])
    return table.take(pa.array(order[last]))


class ParquetStore:
    def __init__(self, root: str | Path, steps_per_partition: int = 1000, max_steps: Optional[int] = None,
                 max_age_s: Optional[float] = None):
        self.root = Path(root)
        self.steps_per_partition = steps_per_partition
        self.max_steps, self.max_age_s = max_steps, max_age_s

    def job_dir(self, job: str) -> Path:
        return self.root / f"job={check_job(job)}"

    def jobs(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name[4:] for p in self.root.iterdir() if p.is_dir() and p.name.startswith("job="))

    def _partitions(self, job: str) -> list[tuple[int, int, Path]]:
        folder = self.job_dir(job)
        if not folder.is_dir():
            return []
        found = []
        for p in folder.iterdir():
            m = _PARTITION.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), int(m.group(2)), p))
        return sorted(found)

    def _partition_dir(self, job: str, step: int) -> Path:
        lo = step // self.steps_per_partition * self.steps_per_partition
        return self.job_dir(job) / f"steps={lo:09d}-{lo + self.steps_per_partition - 1:09d}"

    # -- writing -----------------------------------------------------------------------------

    def write(self, job: str, records: list[dict], node: str = "", incarnation: Optional[int] = None) -> int:
        """Writes StepTimings dicts as one new file per step range touched; returns rows written."""
        if not records:
            return 0
        table = to_table(records, node, incarnation)
        lows = table["step"].to_numpy() // self.steps_per_partition * self.steps_per_partition
        for lo in np.unique(lows):
            part = table.filter(pa.array(lows == lo))
            _write_atomic(part, self._partition_dir(job, int(lo)))
        return table.num_rows

    def compact(self, job: str, before_step: int, max_files: int = 64) -> int:
        """Merges the files of every step range that ends before `before_step`, and of any range that
        has gathered `max_files` (the open one: a flush every few seconds); returns ranges merged."""
        merged = 0
        for _, hi, folder in self._partitions(job):
            files = sorted(folder.glob("part-*.parquet"))
            if len(files) < 2 or (hi >= before_step and len(files) < max_files):
                continue
            table = dedupe(pa.concat_tables([pq.read_table(f, schema=SCHEMA) for f in files]))
            _write_atomic(table, folder)  # written before the old files go: a reader sees rows twice, never none
            for f in files:
                f.unlink(missing_ok=True)
            merged += 1
        return merged

    def apply_retention(self, job: str, now: Optional[float] = None) -> int:
        """Deletes step ranges older than `max_steps` behind the newest step and files older than `max_age_s`."""
        removed = 0
        parts = self._partitions(job)
        if self.max_steps is not None and parts:
            newest = self.step_range(job)
            keep_from = (newest[1] if newest else 0) - self.max_steps + 1
            for _, hi, folder in parts:
                if hi < keep_from:
                    removed += len(list(folder.glob("part-*.parquet")))
                    shutil.rmtree(folder, ignore_errors=True)
        if self.max_age_s is not None:
            cutoff = (now or time.time()) - self.max_age_s
            for _, _, folder in self._partitions(job):
                for f in folder.glob("part-*.parquet"):
                    if f.stat().st_mtime < cutoff:
                        f.unlink(missing_ok=True)
                        removed += 1
                if not any(folder.iterdir()):
                    folder.rmdir()
        return removed

    # -- reading -----------------------------------------------------------------------------

    def read_table(self, job: str, first: Optional[int] = None, last: Optional[int] = None) -> pa.Table:
        """Rows of steps first..last (inclusive; None = open), one per (step, rank), sorted."""
        bounds = ([("step", ">=", first)] if first is not None else []) + \
                 ([("step", "<=", last)] if last is not None else [])
        tables: list[pa.Table] = []
        for _ in range(2):
            files = [f for lo, hi, folder in self._partitions(job)
                     if (first is None or hi >= first) and (last is None or lo <= last)
                     for f in sorted(folder.glob("part-*.parquet"))]
            try:
                tables = [pq.read_table(f, schema=SCHEMA, filters=bounds or None) for f in files]
                break
            except FileNotFoundError:  # compacted or retired while we listed: list again
                tables = []
        if not tables:
            return SCHEMA.empty_table()
        return dedupe(pa.concat_tables(tables))

    def read(self, job: str, first: Optional[int] = None, last: Optional[int] = None) -> list[dict]:
        return to_records(self.read_table(job, first, last))

    def step_range(self, job: str) -> Optional[tuple[int, int]]:
        """(first, last) step stored, from the Parquet footers' statistics (no data is read)."""
        bounds = []
        for _, _, folder in self._partitions(job):
            for f in folder.glob("part-*.parquet"):
                try:
                    meta = pq.ParquetFile(f).metadata
                except FileNotFoundError:
                    continue  # compacted or retired meanwhile
                column = meta.schema.names.index("step")
                for i in range(meta.num_row_groups):
                    stats = meta.row_group(i).column(column).statistics
                    if stats is not None and stats.has_min_max:
                        bounds.append((stats.min, stats.max))
        if not bounds:
            return None
        return min(lo for lo, _ in bounds), max(hi for _, hi in bounds)

    # -- side files ----------------------------------------------------------------------------

    def write_status(self, job: str, status: dict) -> None:
        _write_json(self.job_dir(job) / "status.json", status)

    def read_status(self, job: str) -> dict:
        return _read_json(self.job_dir(job) / "status.json") or {}

    def save_offsets(self, job: str, topic_id: Optional[str], offsets: dict[int, int]) -> None:
        _write_json(self.job_dir(job) / "_offsets.json", {"topic_id": topic_id, "offsets": offsets})

    def load_offsets(self, job: str) -> tuple[Optional[str], dict[int, int]]:
        saved = _read_json(self.job_dir(job) / "_offsets.json") or {}
        return saved.get("topic_id"), {int(p): int(o) for p, o in (saved.get("offsets") or {}).items()}


def _write_atomic(table: pa.Table, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    name = f"part-{time.time_ns()}-{os.getpid()}-{threading.get_ident() % 10_000}"
    tmp = folder / f".{name}.tmp"
    pq.write_table(table, tmp, compression="zstd")
    tmp.rename(folder / f"{name}.parquet")


def _write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)


def _read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


class MetricsConsumer(threading.Thread):
    """Reads `<job>.metrics` (no consumer group) into a ParquetStore; resumes from the stored offsets.

    `on_records(records)` sees each flushed list of StepTimings dicts (the straggler monitor,
    Prometheus' latest values); it runs on this thread and must be quick.
    """

    def __init__(self, bootstrap: str, job: str, store: ParquetStore, *, flush_rows: int = 5000,
                 flush_s: float = 2.0, retention_s: float = 60.0,
                 on_records: Optional[Callable[[list[dict]], None]] = None, **reader_options):
        super().__init__(name="metrics-store", daemon=True)
        self.job, self.store = check_job(job), store
        self.flush_rows, self.flush_s, self.retention_s = flush_rows, flush_s, retention_s
        self.on_records = on_records
        self._reader_args = (bootstrap, topic(job, "metrics"), reader_options)
        self._halt = threading.Event()
        self._buffer: list[dict] = []
        self.stored = 0  # rows written
        self.dropped_by_senders = 0  # records publishers reported dropping (their queue was full)
        self.ignored = 0  # malformed records, or other jobs'
        self.newest_step = -1
        self.taken = 0  # records read off the topic, stored or not
        self.error: Optional[str] = None

    def run(self) -> None:
        from ..bus import TopicReader

        bootstrap, name, options = self._reader_args
        topic_id, offsets = self.store.load_offsets(self.job)
        reader = TopicReader(bootstrap, name, offsets, topic_id, **options)
        next_flush = time.monotonic() + self.flush_s
        next_retention = time.monotonic() + self.retention_s
        try:
            while not self._halt.is_set():
                for record in reader.poll(200):
                    self._take(record.value)
                now = time.monotonic()
                if len(self._buffer) >= self.flush_rows or (now >= next_flush and self._buffer):
                    self._flush(reader)
                    next_flush = now + self.flush_s
                if now >= next_retention:
                    self.store.apply_retention(self.job)
                    next_retention = now + self.retention_s
            self._flush(reader)
        except Exception as e:  # a full disk or a bad path: say so once, in one line, and stop storing
            self.error = f"{type(e).__name__}: {e}"
            log.error("metrics store for job %s stopped: %s", self.job, self.error)
        finally:
            reader.close()

    def _take(self, raw: bytes) -> None:
        self.taken += 1
        try:
            batch = decode(raw)
        except RecordError as e:
            self.ignored += 1
            if self.ignored <= 5:
                log.warning("metrics store: ignored a record on %s: %s", topic(self.job, "metrics"), e)
            return
        if batch is None:
            return  # a `metric` for the control plane
        if batch.job != self.job:
            self.ignored += 1
            return
        self.dropped_by_senders += batch.dropped
        for r in batch.records:
            # A record's own incarnation wins: one executor's publisher spans several incarnations.
            self._buffer.append({"node": batch.node, "incarnation": batch.incarnation, **r})

    def _flush(self, reader) -> None:
        if self._buffer:
            records, self._buffer = self._buffer, []
            self.stored += self.store.write(self.job, records)
            self.newest_step = max(self.newest_step, max(r["step"] for r in records))
            size = self.store.steps_per_partition
            self.store.compact(self.job, before_step=self.newest_step // size * size)
            if self.on_records is not None:
                self.on_records(records)
        self.store.save_offsets(self.job, *reader.positions())

    def stop(self, timeout: float = 10.0) -> None:
        self._halt.set()
        self.join(timeout)

    def drain(self, quiet_s: float = 1.5, timeout: float = 10.0) -> None:
        """Stops once the topic has been quiet for `quiet_s` (the senders are done), storing what was read."""
        deadline, seen, since = time.monotonic() + timeout, -1, time.monotonic()
        while self.is_alive() and time.monotonic() < deadline and time.monotonic() - since < quiet_s:
            if self.taken != seen:
                seen, since = self.taken, time.monotonic()
            time.sleep(0.1)
        self.stop(max(1.0, deadline - time.monotonic()))
