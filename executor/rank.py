"""One rank of a job, as the executor starts it: `python -m megascale.executor.rank SPEC.json`.

Joins the job's process group through the Redis rendezvous of this incarnation, then runs the
engine's `train_rank`. Progress goes to a JSON-lines file the executor tails; errors go to
stderr, which the executor scans.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO

from megascale.lifetime import die_with_parent


@dataclass
class RankSpec:
    """What the executor tells one rank process, as a JSON file beside its log."""
    job: str
    node: str
    incarnation: int
    world_size: int
    config: dict  # the job config, as `JobConfig.to_dict()`
    run_dir: str
    init_method: str  # redis://host:port/<job>?incarnation=N
    resume: bool = False
    rank: int = -1
    local_rank: int = -1
    local_world_size: int = 1
    progress_path: str = ""
    parent_pid: int = 0

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: str | Path) -> "RankSpec":
        return cls(**json.loads(Path(path).read_text()))


class Progress:
    """The progress file: one JSON object per line, flushed at once."""

    def __init__(self, path: str):
        self._f: IO[str] = open(path, "a")

    def write(self, record: dict) -> None:
        self._f.write(json.dumps({**record, "time": time.time()}) + "\n")  # the executor's hang clock reads it
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def main(argv: list[str]) -> int:
    spec = RankSpec.load(argv[0])
    die_with_parent(spec.parent_pid)  # when the node dies, its ranks die with it
    progress = Progress(spec.progress_path)

    import torch
    import torch.distributed as dist

    import megascale.rendezvous  # noqa: F401  registers the redis:// init method
    from megascale.config import from_dict
    from megascale.launch import layout_of, resolve_backend, train_rank
    from megascale.parallel.topology import build_context

    cfg = from_dict(spec.config)
    backend = resolve_backend(cfg.parallelism.backend)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.local_world_size))
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", spec.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    try:
        if spec.world_size > 1:
            dist.init_process_group(backend, init_method=spec.init_method, rank=spec.rank,
                                    world_size=spec.world_size, timeout=timedelta(seconds=cfg.comm.timeout_s))
        ctx = build_context(layout_of(cfg), spec.rank, device, cfg.parallelism.sequence_parallel)
        progress.write({"state": "running"})
        history = train_rank(ctx, cfg, spec.run_dir, on_step=progress.write,
                             on_start=lambda step: progress.write({"restored_step": step}),
                             on_wait=lambda what: progress.write({"waiting": what, "since": time.time()}))
        progress.write({"state": "done", **({"step": history[-1]["step"]} if history else {})})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        progress.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
