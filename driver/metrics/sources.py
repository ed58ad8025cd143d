"""Where the dashboard and `megascale trace` read timings from: the driver's Parquet store or a
local run directory (`megascale train` writes `timings-rank<R>.jsonl`, one StepTimings per line)."""
from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Optional, Protocol

import yaml

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from megascale.common.jsonl import LineFollower
from megascale.common.messages import timings_line
from .store import SCHEMA, ParquetStore, dedupe, to_records, to_table


class TimingsSource(Protocol):
    job: str
    ranks_per_node: Optional[int]  # None: the caller's default

    def step_range(self) -> Optional[tuple[int, int]]: ...
    def read(self, first: Optional[int] = None, last: Optional[int] = None) -> list[dict]: ...
    def status(self) -> dict: ...


class ParquetSource:
    def __init__(self, store: ParquetStore, job: str, ranks_per_node: Optional[int] = None):
        self.store, self.job, self.ranks_per_node = store, job, ranks_per_node

    def step_range(self) -> Optional[tuple[int, int]]:
        return self.store.step_range(self.job)

    def read(self, first: Optional[int] = None, last: Optional[int] = None) -> list[dict]:
        return self.store.read(self.job, first, last)

    def status(self) -> dict:
        return {"job": self.job, **self.store.read_status(self.job)}


_TIMINGS = re.compile(r"timings-rank\d+\.jsonl")
KEEP_STEPS = 100_000  # a run directory's newest steps held in memory: about a day at a step a second
_CHUNK_LINES = 50_000  # parsed at a time: a long run's first read never holds its whole files as dicts


class RunDirSource:
    """A run directory, read incrementally: the files only grow while a run is going. What it has read is held
    as one Arrow table (about 150 bytes a rank-step; a parsed line took 2 KB), the newest `keep_steps` steps of
    it (None: all), so a dashboard left open on a run of weeks stays bounded."""

    def __init__(self, run_dir: str | Path, keep_steps: Optional[int] = KEEP_STEPS):
        self.dir = Path(run_dir)
        if not self.dir.is_dir():
            raise FileNotFoundError(f"run directory {self.dir} does not exist")
        config = _yaml(self.dir / "config.yaml")
        self.config = config
        self.job = str(config.get("name") or self.dir.name)
        par, cluster = config.get("parallelism") or {}, config.get("cluster") or {}
        world = int(par.get("tp", 1)) * int(par.get("pp", 1)) * int(par.get("dp", 1))
        self.ranks_per_node = cluster.get("ranks_per_node") or max(1, world // int(cluster.get("nodes") or 1))
        self.keep_steps = keep_steps
        self._table = SCHEMA.empty_table()  # one row per (step, rank), sorted by step then rank
        self._lines = LineFollower()
        self._lock = threading.Lock()

    def timing_files(self) -> list[Path]:
        """Each rank's timings file (the follower reads its earlier part, common/jsonl.py, with it)."""
        return sorted(p for p in self.dir.glob("timings-rank*.jsonl") if _TIMINGS.fullmatch(p.name))

    def _refresh(self) -> None:
        with self._lock:
            batches = []
            for path in self.timing_files():
                lines = self._lines.read(path)
                for at in range(0, len(lines), _CHUNK_LINES):
                    records = [r for line in lines[at:at + _CHUNK_LINES] if (r := timings_line(line)) is not None]
                    if records:
                        batches.append(to_table(records))
            if batches:  # merged once: every rank's file covers the same steps
                self._add(pa.concat_tables(batches))

    def _add(self, batch: pa.Table) -> None:
        """Merges `batch` in: only the held rows from its first step on are sorted again (a resumed run replays
        steps); the newest row of a (step, rank) wins."""
        held, steps = self._table, self._table["step"].to_numpy()
        cut = int(np.searchsorted(steps, pc.min(batch["step"]).as_py(), side="left"))
        table = pa.concat_tables([held.slice(0, cut), dedupe(pa.concat_tables([held.slice(cut), batch]))])
        if self.keep_steps is not None:
            steps = table["step"].to_numpy()
            table = table.slice(int(np.searchsorted(steps, steps[-1] - self.keep_steps, side="right")))
        self._table = table.combine_chunks() if table["step"].num_chunks > 8 else table

    def step_range(self) -> Optional[tuple[int, int]]:
        self._refresh()
        steps = self._table["step"]
        return (steps[0].as_py(), steps[-1].as_py()) if len(steps) else None

    def read(self, first: Optional[int] = None, last: Optional[int] = None) -> list[dict]:
        self._refresh()
        table, steps = self._table, self._table["step"].to_numpy()
        lo = 0 if first is None else int(np.searchsorted(steps, first, side="left"))
        hi = len(steps) if last is None else int(np.searchsorted(steps, last, side="right"))
        return to_records(table.slice(lo, max(0, hi - lo)))

    def status(self) -> dict:
        """What a finished or running local run can say about itself (no driver: no restarts, no ETTR)."""
        last = _last_json_line(self.dir / "metrics.jsonl") or {}
        total = (self.config.get("train") or {}).get("steps")
        state = "finished" if total and last.get("step", 0) >= total else "running" if last else "starting"
        status = {"job": self.job, "state": state, "step": last.get("step"), "total_steps": total,
                  "loss": last.get("loss"), "tokens_per_s": last.get("tokens_per_s"), "run_dir": str(self.dir)}
        if (self.config.get("eval") or {}).get("every"):  # the newest validation: at most eval.every lines back
            validated = _last_json_line(self.dir / "metrics.jsonl", "val_loss") or {}
            status.update(val_step=validated.get("step"), val_loss=validated.get("val_loss"),
                          val_ppl=validated.get("val_ppl"))
        return status


def open_source(job: Optional[str], parquet: Optional[str] = None, run_dir: Optional[str] = None,
                runs_root: str = "runs", keep_steps: Optional[int] = KEEP_STEPS) -> TimingsSource:
    """The source the CLI flags name; with only JOB, the newest `runs/<JOB>-*` that has timings (a run
    directory's source holding its newest `keep_steps` steps)."""
    if run_dir:
        return RunDirSource(run_dir, keep_steps)
    if parquet:
        store = ParquetStore(parquet)
        jobs = store.jobs()
        if job is None and len(jobs) == 1:
            job = jobs[0]
        if job is None or job not in jobs:
            raise FileNotFoundError(f"no job {job!r} in {parquet} (found: {', '.join(jobs) or 'none'}); "
                                    f"name one of them")
        return ParquetSource(store, job)
    if job and Path(job).is_dir():  # a run directory, as `megascale export RUN_DIR` takes one
        source = _source_of_run(Path(job), keep_steps=keep_steps)
        if source is None:
            raise FileNotFoundError(f"{job}: no per-rank timings (timings-rank*.jsonl or metrics/) in this directory")
        return source
    if job:
        runs = sorted(Path(runs_root).glob(f"{job}-*"), key=lambda p: p.stat().st_mtime, reverse=True)
        source = next((s for run in runs if (s := _source_of_run(run, job, keep_steps)) is not None), None)
        if source is None:
            raise FileNotFoundError(f"no run of job {job!r} with per-rank timings under {runs_root}/; "
                                    f"pass --run-dir RUN or --parquet DIR")
        return source
    raise FileNotFoundError("name a JOB, --run-dir RUN or --parquet DIR")


def _source_of_run(run: Path, job: Optional[str] = None, keep_steps: Optional[int] = KEEP_STEPS
                   ) -> Optional[TimingsSource]:
    """A run directory's timings (of `job`, when given): its driver's metrics store where a driver ran it,
    since that one has the live status, else its ranks' own timings files; None where it has neither."""
    stores = sorted((run / "metrics").glob(f"job={job or '*'}"))
    if stores and stores[0].is_dir():
        return ParquetSource(ParquetStore(run / "metrics"), stores[0].name.removeprefix("job="))
    if any(run.glob("timings-rank*.jsonl")):
        return RunDirSource(run, keep_steps)
    return None


def _yaml(path: Path) -> dict:
    try:
        loaded = yaml.safe_load(path.read_text())
    except (FileNotFoundError, yaml.YAMLError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _last_json_line(path: Path, key: Optional[str] = None) -> Optional[dict]:
    """The last JSON line of `path` (the last with `key`, when given), read backwards in blocks."""
    try:
        with open(path, "rb") as f:
            end, cut = f.seek(0, 2), b""
            while end > 0:
                start = max(0, end - 65536)
                f.seek(start)
                lines = (f.read(end - start) + cut).splitlines()
                cut, end = (lines.pop(0) if start and lines else b""), start  # a line the block began inside
                for line in reversed(lines):
                    try:
                        record = json.loads(line)
                    except ValueError:
                        continue
                    if key is None or key in record:
                        return record
    except FileNotFoundError:
        return None
    return None
