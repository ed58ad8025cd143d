"""What an executor tells each rank process it starts (`RankSpec`, a JSON file beside the rank's log),
and what the rank tells it back (`Progress`, a JSON-lines file the executor tails)."""
from __future__ import annotations

import contextlib
import json
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from megascale.common.jsonl import RollingWriter

# The executor's request for a rank process's threads' stacks, into its log: asked of a rank that did not leave
# its incarnation when ordered, before it is stopped, so that the log says where it was stuck. The rank answers
# from faulthandler's C handler, so a main thread blocked in a collective answers too.
STACKS_SIGNAL = signal.SIGUSR2


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


def nan_loss_order(progress_path: str | Path) -> Path:
    """The file `megascale chaos nan-loss` creates beside the reporting rank's progress file: that rank's next
    step report then carries a NaN loss, once (it deletes the file). The driver's nan_loss recovery runs end to
    end while the training state stays finite, so replayed losses still equal an uninterrupted run's."""
    return Path(f"{progress_path}.nan-loss")


class Progress:
    """The progress file: one JSON object per line, flushed at once, rolled over past `max_bytes`."""

    def __init__(self, path: str, max_bytes: Optional[int] = None):
        self._f = RollingWriter(path, max_bytes)
        self._nan_loss = nan_loss_order(path)

    def write(self, record: dict) -> None:
        if "loss" in record and self._nan_loss.exists():  # a stat per step report: microseconds
            with contextlib.suppress(FileNotFoundError):
                self._nan_loss.unlink()
                record = {**record, "loss": float("nan")}
        self._f.write(json.dumps({**record, "time": time.time()}))  # the executor's hang clock reads it

    def close(self) -> None:
        self._f.close()
