"""A stand-in rank for control-plane tests: no torch, no rendezvous, just steps on a timer.

The executor runs it instead of the training entry point when MEGASCALE_RANK_ENTRY points here.
FAKE_STEP_S: seconds per step. FAKE_FAIL: "RANK:STEP" makes that rank raise at that step in
incarnation 1 only (a restart then succeeds). FAKE_SLOW_RANK: that rank's steps take 3x as
long in its timings file (`<run_dir>/timings-rank<R>.jsonl`), a straggler for the detector.
FAKE_HANG_AT: every rank stops advancing after that step (a hang; the processes stay up).
"""
import os
import sys
import time

from megascale.driver.sim_rank import step_timings, timings_file, write_line
from megascale.common.rankspec import Progress, RankSpec
from megascale.common.lifetime import die_with_parent

spec = RankSpec.load(sys.argv[1])
die_with_parent(spec.parent_pid)
progress = Progress(spec.progress_path)
steps = spec.config["train"]["steps"]
step_s = float(os.environ.get("FAKE_STEP_S", "0.2"))
fail_rank, _, fail_step = os.environ.get("FAKE_FAIL", "-1:-1").partition(":")
slow = spec.rank == int(os.environ.get("FAKE_SLOW_RANK", "-1"))
hang_at = int(os.environ.get("FAKE_HANG_AT", "-1"))
timings = timings_file(spec)
progress.write({"state": "running"})
for step in range(1, steps + 1):
    wall = time.time()
    time.sleep(step_s)
    write_line(timings, step_timings(spec, step, wall, step_s * (3 if slow else 1)))
    if spec.rank == int(fail_rank) and step == int(fail_step) and spec.incarnation == 1:
        raise RuntimeError(f"injected failure at step {step}")
    if spec.rank == spec.world_size - 1:  # one reporting rank, like train_rank
        progress.write({"step": step, "loss": 10.0 / step, "step_time": step_s, "tokens_per_s": 1000.0,
                        "grad_norm": 1.0, "lr": 0.01})
    while step == hang_at:
        time.sleep(1)
progress.write({"state": "done", "step": steps})
