"""What `megascale run / launch / train` check on this machine before anything starts: a job that
cannot run fails here in one line, not after control.max_restarts identical crashes of its ranks."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from megascale.config import ConfigError, JobConfig


def preflight(cfg: JobConfig) -> JobConfig:
    """`cfg` with data.path absolute (ranks and executors may run elsewhere), once its inputs exist
    and its checkpoint.uri is fit for a fresh start; ConfigError naming the field otherwise."""
    from megascale.checkpoint import CheckpointError, check_fresh_start

    if cfg.data.source != "synthetic" and cfg.data.path:
        path = Path(cfg.data.path).expanduser()
        if not path.exists():
            where = "" if path.is_absolute() else f" (relative paths are from the current directory, {Path.cwd()})"
            raise ConfigError(f"data.path={cfg.data.path}: not found{where}")
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(path.resolve())))
    try:
        check_fresh_start(cfg.checkpoint.uri, cfg.checkpoint.resume, cfg.checkpoint.filesystem)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    return cfg
