"""What an executor tells each rank process it starts (`RankSpec`, a JSON file beside the rank's log),
and what the rank tells it back (`Progress`, a JSON-lines file the executor tails)."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO


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
