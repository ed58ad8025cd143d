"""What an in-process restart leaves in a rank's memory: 2 ranks (tp2, sequence parallel) of the soak's model
go through `cycles` incarnations the way executor/rank.py takes them (the rendezvous, its random streams put
back, `train_rank` on the kept trainer, a leave part-way through a step, abort, shutdown, `release`), and each
rank's anonymous memory is read once it has left.

A soak with a fault every 2 minutes restarts a rank every few minutes, so a rank's time slope mixes what
each incarnation adds with what time adds. Counted per incarnation, the two part: a heap that grows for its
first few incarnations and then stops is warm-up; one that grows at the end still is a leak per recovery.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import psutil

from megascale.bench.soak_fits import anon_mb, growth_per_100, shmem_mb
from megascale.checkpoint.client import shutdown_keeper

RANKS = 2


class _Leave(BaseException):
    """Raised in the reporting rank's step callback: the rank leaves mid-incarnation, as at the executor's order."""


def _rank(rank: int, root: str, cycles: int, steps: int) -> None:
    import torch

    from megascale.bench.soak import job_config
    from megascale.config import from_dict
    from megascale.executor.rank import FreshState, release
    from megascale.rank import abort_rank, init_rank, shutdown_rank
    from megascale.train import KeptTrainer, layout_of, train_rank

    torch.set_num_threads(1)
    raw = job_config(Path(root), steps=1_000_000)
    raw.update(parallelism={"tp": RANKS, "sequence_parallel": True}, batch={"micro": 2, "global": 4},
               checkpoint={"uri": f"{root}/ckpt", "every": max(1, steps // 2)}, logging={"tensorboard": False})
    raw["train"]["run_dir"] = root
    del raw["cluster"], raw["control"]
    cfg = from_dict(raw)
    kept, fresh, anon, file = KeptTrainer(), FreshState(), [], []
    for cycle in range(cycles):
        ctx = init_rank(layout_of(cfg), rank, f"file://{root}/rendezvous-{cycle}", cfg.comm, backend="gloo",
                        sequence_parallel=True, local_rank=rank, local_world_size=RANKS, threads=1)
        fresh.apply(ctx.device)
        done = [0]

        def leave_after_steps(stats: dict) -> None:
            done[0] += 1
            if done[0] >= steps:
                raise _Leave()

        try:
            train_rank(ctx, cfg, root, on_step=leave_after_steps if rank == 0 else None, kept=kept)
        except _Leave:
            pass
        except RuntimeError:  # rank 1, in a collective its peer left: a failed incarnation, as in a restart
            pass
        abort_rank()
        shutdown_rank(ctx)
        release()
        memory = psutil.Process().memory_info()
        anon.append(round(anon_mb(memory), 1))
        file.append(round(memory.shared / 2**20 - (shmem_mb(os.getpid()) or 0.0), 1))
    (Path(root) / f"memory-{rank}.json").write_text(json.dumps({"anon_mb": anon, "file_mb": file}))


def incarnation_memory(cycles: int = 16, steps: int = 6) -> dict:
    """Each rank's anonymous MB after each incarnation, and its growth per incarnation fitted over the second
    half (past the heap's warm-up): what 100 recoveries would add to a rank that lives through them. Also each
    rank's file-backed MB (`file_mb`) and the most any rank's grew from its second incarnation to its last
    (`file_mb_added_after_second`; None below 3 incarnations): code a restart runs is paged in by the first
    restarts, then stays."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="megascale-bench-incarnations-") as root:
        try:
            mp.spawn(_rank, args=(root, cycles, steps), nprocs=RANKS)
        finally:  # the ranks' keeper would otherwise wait out its 15 idle minutes on a directory now gone
            shutdown_keeper(f"{root}/ckpt")
        memory = [json.loads((Path(root) / f"memory-{rank}.json").read_text()) for rank in range(RANKS)]
    anon, file = [m["anon_mb"] for m in memory], [m["file_mb"] for m in memory]
    return {"ranks": RANKS, "layout": "tp2", "steps_per_incarnation": steps, "anon_mb": anon,
            "mb_per_100_incarnations": max((g for series in anon if (g := growth_per_100(series)) is not None),
                                           default=None),
            "file_mb": file,
            "file_mb_added_after_second": max(round(series[-1] - series[1], 1) for series in file)
            if cycles > 2 else None}

