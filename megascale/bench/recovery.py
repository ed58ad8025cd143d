"""`megascale bench recovery`: MTTR and ETTR of automatic recovery on a local 4-node job.

Stand-in ranks (driver/sim_rank.py) keep it to CPU seconds; the control plane, services, chaos
and recovery are the real ones. Faults of mixed kinds are injected one after another, each once
the previous recovery has caught up (or `--fault-interval S` after the previous one); per fault
the driver's own timings are reported. Stand-ins start in milliseconds, so this measures detection;
`--real` (recovery_real.py) measures what a fault costs with real GPT ranks.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import psutil
import redis
import yaml

from megascale.bench import BenchFailed
from megascale.driver import sim_rank
from megascale.driver.chaos import inject
from megascale.driver.services import JobHandle
from megascale.driver.recovery.timings import recovered, recoveries_after
from megascale.driver.state import JobStore

JOB = "bench-recovery"
HEARTBEAT_S = 0.5
HANG_AFTER_S = 2 * HEARTBEAT_S


def wait_for(predicate: Callable[[], object], timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.2)
    raise BenchFailed(f"timed out after {timeout:.0f} s waiting for {what}")


def run(args: argparse.Namespace) -> dict:
    if getattr(args, "real", False):
        from . import recovery_real  # imports this module's wait_for

        return recovery_real.run(args)
    interval = getattr(args, "fault_interval", 0.0) or 0.0
    if interval < 0:
        raise SystemExit(f"megascale bench recovery: --fault-interval={interval}: must be >= 0")
    kinds = ["kill-rank", "kill-node", "hang"] + ([] if getattr(args, "quick", False) else ["freeze-node", "kill-rank"])
    count = getattr(args, "faults", 0) or len(kinds)
    if count < 0:
        raise SystemExit(f"megascale bench recovery: --faults={count}: must be >= 0")
    rng = random.Random(0)  # which active node each fault hits: node faults evict, so the node is chosen live
    with tempfile.TemporaryDirectory(prefix="megascale-bench-recovery-") as tmp:
        root = Path(tmp)
        config = {"name": JOB, "model": {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq": 16},
                  "parallelism": {"dp": 4}, "batch": {"micro": 1, "global": 4},
                  "cluster": {"nodes": 4, "spares": 2},
                  # Silence and hang thresholds of 2 heartbeat intervals: the detection goal.
                  "control": {"heartbeat_s": HEARTBEAT_S, "dead_after_s": 2 * HEARTBEAT_S,
                              "hang_after_s": HANG_AFTER_S,
                              "selfcheck": False, "max_restarts": 10 + count, "start_timeout_s": 90,
                              "command_timeout_s": 20},
                  "checkpoint": {"uri": str(root / "ckpt"), "every": 10},
                  "train": {"steps": 100000, "run_dir": str(root / "runs")}}
        path = root / "job.yaml"
        path.write_text(yaml.safe_dump(config))
        env = {**os.environ, "MEGASCALE_HOME": str(root / "home"), "MEGASCALE_RANK_ENTRY": sim_rank.__file__,
               "SIM_STEP_S": "0.1"}
        os.environ["MEGASCALE_HOME"] = env["MEGASCALE_HOME"]  # JobHandle.load reads it here
        subprocess.run([sys.executable, "-m", "megascale.cli", "launch", str(path)], env=env, check=True,
                       capture_output=True, timeout=90)
        handle = JobHandle.load(JOB)
        store = JobStore.from_url(handle.redis_url, JOB, secrets=handle.job_secrets())
        try:
            status = functools.partial(_job_status, store)
            wait_for(lambda: (status().get("step") or 0) >= 15, 60, "training progress")
            injected = []
            driver_rss_mb, record_kb, faults = [], [], []
            for i in range(count):
                kind, now = kinds[i % len(kinds)], status()
                node = rng.choice([n["node"] for n in now["nodes"] if n["role"] == "active"])
                before = recovered(now)
                injected.append(time.time())
                inject(store, kind, node)
                faults += wait_for(lambda: recoveries_after(status(), before), 60, f"recovery from {kind} on {node}")
                time.sleep(max(1.0, interval - (time.time() - injected[-1])))  # steady training between faults
                driver_rss_mb.append(_rss_mb(JobHandle.load(JOB).driver_pid))
                record_kb.append(round(len(store.r.get(store.k_record) or b"") / 1024, 2))
            final = status()
        finally:
            with contextlib.suppress(redis.RedisError):  # a job that ended took its Redis with it
                store.set_desired("stopped")
            wait_for(lambda: not handle.live() or JobHandle.load(JOB).final, 60, "the job to stop")
    gaps = [b - a for a, b in zip(injected, injected[1:])]
    return {
        "faults": faults,
        "detection_intervals_max": round(max(f["detection_s"] for f in faults) / HEARTBEAT_S, 2),
        "detection_intervals_by_kind": {kind: round(max(f["detection_s"] for f in faults if f["kind"] == kind)
                                                    / HEARTBEAT_S, 2) for kind in sorted({f["kind"] for f in faults})},
        # A hang is by definition hang_after_s without progress: what detection adds beyond that.
        "hang_detection_past_threshold_s": max((round(f["detection_s"] - HANG_AFTER_S, 2) for f in faults
                                                if f["kind"] == "hang"), default=None),
        "resume_s_max": round(max(f["diagnosis_s"] + f["restart_s"] for f in faults), 2),
        "lost_s_per_fault_max": round(max(f["total_s"] for f in faults), 2),
        "steps_lost_max": max(f["steps_lost"] for f in faults),
        "ettr": final.get("ettr"),
        "mttr_s": final.get("mttr_s"),
        "fault_interval_s": round(sum(gaps) / len(gaps), 2) if gaps else None,
        # ETTR at one fault every 5 minutes, counting the time the faults cost (the run's own
        # ettr is at fault_interval_s, a fault every few seconds).
        "ettr_at_5min_interval": round(1 - sum(f["total_s"] for f in faults) / len(faults) / 300, 4),
        "heartbeat_s": HEARTBEAT_S,
        "driver_rss_mb": driver_rss_mb,
        "driver_rss_mb_per_100_recoveries": per_100_recoveries(driver_rss_mb, len(kinds)),
        "evicted": final.get("evicted"),
        "job_record_kb": record_kb,  # what the driver rewrites every pass
        "job_record_kb_per_100_recoveries": per_100_recoveries(record_kb, len(kinds)),
    }


def _job_status(store: JobStore) -> dict:
    """The driver's status; a job that ended early (its services gone with it) fails the benchmark in one line."""
    try:
        return json.loads(store.r.get(store.k_status) or "{}")
    except redis.RedisError:
        final = JobHandle.load(JOB).final or {}
        raise BenchFailed(f"the job ended before the benchmark did: {final.get('state', 'gone')} "
                          f"{final.get('reason', '')}".rstrip()) from None


def _rss_mb(pid: int | None) -> float | None:
    try:
        return round(psutil.Process(pid).memory_info().rss / 2**20, 1) if pid else None
    except psutil.Error:
        return None


def per_100_recoveries(after_each: list[float | None], cycle: int) -> float | None:
    """Growth per 100 recoveries of a figure read after each one (the driver's RSS, the job record's size), over
    the second half of them, past two cycles of fault kinds at least: what weeks of faults would add. Left out,
    what happens once early on: every code path's first run, the metrics store's first compaction (step 1,000),
    which starts pyarrow's I/O threads (+13 MB, 4 threads, whatever the recoveries), the first evicted nodes
    the record keeps (state.EVICTED_KEPT). None with fewer than 10 such points."""
    settled = [(i, v) for i, v in enumerate(after_each) if v is not None and i >= max(2 * cycle, len(after_each) // 2)]
    if len(settled) < 10:
        return None
    x, y = np.array(settled).T
    return round(float(np.polyfit(x, y, 1)[0]) * 100, 2)
