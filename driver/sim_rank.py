"""The stand-in rank (no torch, no model) for control-plane, recovery and Kubernetes tests, chaos demos,
`bench recovery` and local runs: point MEGASCALE_RANK_ENTRY at this file.

Each step is a simulated all-reduce over every rank, recorded in the same flight-recorder file
real ranks write (`<run_dir>/flight-rank<R>.bin`); the "collective" completes once every peer's
recorder shows it entered the same step, so a stopped, hung or dead rank stalls the others exactly
where a real collective would, and the driver's hang localisation sees a real picture.

Each step also appends a StepTimings line to `<run_dir>/timings-rank<R>.jsonl`, like
`megascale.train.train_rank`, so the executor's timings pipeline has something to ship: the sleep
is `forward` (compute), the wait for the peers `comm_dp` and `exposed_dp`, as the real timers
record a DP all-reduce, so the straggler detector's `compute` is the sleep alone. The sleep stands
for work: time the process spends stopped (`megascale chaos slow-rank` stops and resumes it) does
not count towards it, so a throttled stand-in is slowed as a computing rank would be.

Env:
  SIM_STEP_S       seconds of compute per step (default 0.2).
  SIM_SLOW_NODE    NODE[:FACTOR]: ranks on that node (RankSpec.node, not a rank number, so a spare
                   taking over its ranks is fast again) compute FACTOR (default 3) times as long.
  SIM_SLOW_RANK    RANK[:FACTOR]: that rank alone computes FACTOR (default 3) times as long.
  SIM_NAN_AT       STEP: the reporting rank's loss is NaN from that step on (a diverged run).
  SIM_ERROR_AT     RANK:STEP: that rank prints an NCCL watchdog timeout line at that step and
                   keeps running.
  SIM_FAIL_AT      RANK:STEP: that rank raises at that step (the process exits 1).
  SIM_HANG_AT      RANK:STEP: that rank stops advancing after that step, its process still up (a
                   hang: its peers wait for it in the next all-reduce).
The faults fire once per job: the first incarnation to reach the step creates a marker file in the
run directory, so the restarted incarnation runs clean.

With checkpoint.uri and checkpoint.every set it "checkpoints" every checkpoint.every steps into
`<uri>/sim-step` and resumes from there, so restarts lose work the way real ones do.
"""
from __future__ import annotations

import json
import os
import signal
import struct
import sys
import time
from pathlib import Path

from megascale.common.flight_format import read_records
from megascale.common.jsonl import RollingWriter
from megascale.common.lifetime import die_with_parent
from megascale.common.rankspec import Progress, RankSpec
from megascale.config import from_dict
from megascale.driver.metrics.schema import SEGMENTS
from megascale.parallel.flight_recorder import FlightRecorder

WATCHDOG_LINE = ("[rank{rank}]:[E ProcessGroupNCCL.cpp:616] [Rank {rank}] Watchdog caught collective operation "
                 "timeout: WorkNCCL(SeqNum={step}, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) "
                 "ran for 600013 milliseconds before timing out.")


def entered(path: Path, seq: int) -> bool:
    try:
        return any(r.seq >= seq for r in read_records(path))
    except (OSError, ValueError, IndexError, struct.error):
        return False  # not created yet, or being truncated by a restarting peer


def step_timings(spec: RankSpec, step: int, start: float, compute: float, waited: float = 0.0) -> dict:
    """A StepTimings dict (megascale.timers) for a stand-in step: `compute` seconds of forward, then
    `waited` seconds in the DP all-reduce."""
    par = spec.config.get("parallelism", {})
    tp, dp = int(par.get("tp", 1)), int(par.get("dp", 1))
    segments = {**dict.fromkeys(SEGMENTS, 0.0), "forward": compute, "comm_dp": waited, "exposed_dp": waited}
    return {"step": step, "rank": spec.rank, "tp": spec.rank % tp, "dp": spec.rank // tp % dp,
            "pp": spec.rank // (tp * dp), "start": start, "total": compute + waited, "segments": segments}




def first_time(run_dir: Path, name: str) -> bool:
    """True for the first caller in this run directory only (the marker file is created atomically)."""
    try:
        (run_dir / f"sim-{name}.fired").open("x").close()
        return True
    except FileExistsError:
        return False


def compute_seconds(spec: RankSpec) -> float:
    """SIM_STEP_S, times the slow-down factor when SIM_SLOW_NODE or SIM_SLOW_RANK names this rank."""
    seconds = float(os.environ.get("SIM_STEP_S", "0.2"))
    for variable, who in (("SIM_SLOW_NODE", spec.node), ("SIM_SLOW_RANK", str(spec.rank))):
        slow, _, factor = os.environ.get(variable, "").partition(":")
        if slow == who:
            seconds *= float(factor or 3)
    return seconds


class Work:
    """Sleeps as if computing: in slices of SLICE_S; a slice during which the process was stopped (a
    SIGCONT arrived) counts half a slice, the expected share done before the stop."""

    SLICE_S = 0.005

    def __init__(self) -> None:
        self.resumed = False
        signal.signal(signal.SIGCONT, lambda *_: setattr(self, "resumed", True))

    def __call__(self, seconds: float) -> None:
        done = 0.0
        while done < seconds:
            piece = min(self.SLICE_S, seconds - done)
            self.resumed, began = False, time.monotonic()
            time.sleep(piece)
            done += piece / 2 if self.resumed else time.monotonic() - began


def fault_step(variable: str, spec: RankSpec) -> int:
    """The step of a RANK:STEP fault aimed at this rank, else 0 (never)."""
    rank, _, step = os.environ.get(variable, "").partition(":")
    return int(step) if rank and int(rank) == spec.rank else 0


def main() -> int:
    spec = RankSpec.load(sys.argv[1])
    die_with_parent(spec.parent_pid)
    cfg = spec.config
    max_bytes = from_dict(cfg).logging.jsonl_max_bytes()  # rolled over as a real rank's (common/jsonl.py)
    progress = Progress(spec.progress_path, max_bytes)
    steps, step_s = cfg["train"]["steps"], compute_seconds(spec)
    nan_at = int(os.environ.get("SIM_NAN_AT", "0"))
    error_at, fail_at, hang_at = (fault_step(v, spec) for v in ("SIM_ERROR_AT", "SIM_FAIL_AT", "SIM_HANG_AT"))
    diverged = False
    run_dir = Path(spec.run_dir)
    ckpt = cfg.get("checkpoint", {})
    mark = Path(ckpt["uri"]) / "sim-step" if ckpt.get("uri") else None
    start = int(mark.read_text()) if mark and spec.resume and mark.exists() else 0
    recorder = FlightRecorder(run_dir / f"flight-rank{spec.rank}.bin", capacity=64)
    peers = [run_dir / f"flight-rank{r}.bin" for r in range(spec.world_size) if r != spec.rank]
    progress.write({"state": "running", "restored_step": start})
    timings = RollingWriter(run_dir / f"timings-rank{spec.rank}.jsonl", max_bytes)
    work = Work()
    for step in range(start + 1, steps + 1):
        began, wall = time.monotonic(), time.time()
        work(step_s)
        computed = time.monotonic()
        slot = recorder.begin("all_reduce", "dp:0", spec.world_size)
        seq = step - start
        while not all(entered(p, seq) for p in peers):
            time.sleep(0.01)
        recorder.end(slot)
        timings.write(json.dumps(step_timings(spec, step, wall, computed - began, time.monotonic() - computed)))
        if step == error_at and first_time(run_dir, "error"):
            print(WATCHDOG_LINE.format(rank=spec.rank, step=step), file=sys.stderr, flush=True)
        if step == fail_at and first_time(run_dir, "fail"):
            raise RuntimeError(f"injected failure at step {step}")
        if mark and ckpt.get("every") and step % ckpt["every"] == 0 and spec.rank == 0:
            mark.parent.mkdir(parents=True, exist_ok=True)
            tmp = mark.with_suffix(".tmp")
            tmp.write_text(str(step))
            tmp.replace(mark)  # committed atomically, like a manifest
        if spec.rank == spec.world_size - 1:  # one reporting rank, like train_rank
            diverged = diverged or (step == nan_at and first_time(run_dir, "nan"))
            progress.write({"step": step, "loss": float("nan") if diverged else 10.0 / step, "lr": 0.01,
                            "step_time": time.monotonic() - began, "tokens_per_s": 1000.0, "grad_norm": 1.0})
        if step == hang_at and first_time(run_dir, "hang"):
            while True:  # until the executor stops it
                time.sleep(1)
    progress.write({"state": "done", "step": steps})
    return 0


if __name__ == "__main__":
    sys.exit(main())
