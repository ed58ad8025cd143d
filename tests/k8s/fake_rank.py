"""A stand-in rank for the operator's scenario: no torch, no rendezvous, a step every FAKE_STEP_S.

The executor runs it instead of the training entry point when MEGASCALE_RANK_ENTRY points here.
"""
import os
import sys
import time

from megascale.common.rankspec import Progress, RankSpec
from megascale.common.lifetime import die_with_parent

spec = RankSpec.load(sys.argv[1])
die_with_parent(spec.parent_pid)
progress = Progress(spec.progress_path)
step_s = float(os.environ.get("FAKE_STEP_S", "0.2"))
progress.write({"state": "running"})
for step in range(1, spec.config["train"]["steps"] + 1):
    time.sleep(step_s)
    if spec.rank == spec.world_size - 1:  # one reporting rank, like train_rank
        progress.write({"step": step, "loss": 10.0 / step, "step_time": step_s, "tokens_per_s": 1000.0,
                        "grad_norm": 1.0, "lr": 0.01})
progress.write({"state": "done", "step": spec.config["train"]["steps"]})
