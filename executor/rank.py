"""One rank of a job, as the executor starts it: `python -m megascale.executor.rank SPEC.json`.

Starts as every rank does (`megascale.rank.init_rank`, through the Redis rendezvous of this
incarnation), then runs the engine's `train_rank`. Progress goes to a JSON-lines file the executor tails; errors go to
stderr, which the executor scans.
"""
from __future__ import annotations

import sys
import time

from megascale.common.lifetime import die_with_parent
from megascale.common.rankspec import Progress, RankSpec


def main(argv: list[str]) -> int:
    spec = RankSpec.load(argv[0])
    die_with_parent(spec.parent_pid)  # when the node dies, its ranks die with it
    progress = Progress(spec.progress_path)

    from megascale.config import from_dict
    from megascale.rank import init_rank, shutdown_rank
    from megascale.train import layout_of, train_rank

    cfg = from_dict(spec.config)
    try:
        ctx = init_rank(layout_of(cfg), spec.rank, spec.init_method, cfg.comm, backend=cfg.parallelism.backend,
                        sequence_parallel=cfg.parallelism.sequence_parallel, local_rank=spec.local_rank,
                        local_world_size=spec.local_world_size, flight_dir=spec.run_dir)
        progress.write({"state": "running"})
        history = train_rank(ctx, cfg, spec.run_dir, on_step=progress.write,
                             on_start=lambda step: progress.write({"restored_step": step}),
                             on_wait=lambda what: progress.write({"waiting": what, "since": time.time()}))
        progress.write({"state": "done", **({"step": history[-1]["step"]} if history else {})})
    finally:
        shutdown_rank()
        progress.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
